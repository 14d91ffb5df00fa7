"""One run live in this process: its lock, the preflight's inputs, the engines started early, the flow's live
objects and its directory. Opened the same way by the CLI and by a flow a deployment starts, closed in one place.

Prefect task parameters must stay small and JSON-able (docs/design.md), so tasks receive (run_id, step) and find
the live objects with `live(run_id, kind)`. The CLI opens the run before anything starts (the lock first, so a
second run on the same directory is refused with one line), hands it the inputs its preflight checked and the
engines it started early, and calls the flow, which enters the same `LiveRun`; a deployment's flow opens it itself
and prepares its own inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sluiceway.flows.config import RunConfig
from sluiceway.infra import held_lines
from sluiceway.storage import run_lock
from sluiceway.storage.object_store import ObjectStore

if TYPE_CHECKING:
    from sluiceway.flows.engines import RolloutEngines

T = TypeVar("T")


@dataclass(eq=False)
class LiveRun:
    cfg: RunConfig
    command: str
    run_dir: Path
    store: ObjectStore  # the run's tables
    lock: run_lock.RunLock
    prepared: Any = None  # what the CLI's preflight checked, until the flow takes it
    early_engines: RolloutEngines | None = None  # started by the CLI before its imports, until the flow takes them
    state: Any = None  # the flow's live objects while it runs (flows/runtime.py `Runtime`, an SFT, replay or eval run)

    def take_prepared(self, prepare: Callable[[RunConfig], T]) -> T:
        """The preflight's inputs, or `prepare(cfg)`'s where no preflight ran (a deployment's worker); then the
        run has started: the lines held until now are logged (infra/held_lines.py)."""
        prep, self.prepared = self.prepared, None
        if prep is None:
            prep = prepare(self.cfg)
        held_lines.flush()
        return prep

    def take_early_engines(self) -> RolloutEngines | None:
        engines, self.early_engines = self.early_engines, None
        return engines

    @contextlib.contextmanager
    def serving(self, state: T, close: Callable[[T], None]) -> Iterator[T]:
        """`state` is what the run's tasks find while the block runs; `close(state)` when it ends, however."""
        self.state = state
        try:
            yield state
        finally:
            self.state = None
            close(state)

    def close(self) -> None:
        """What the flow did not take: engines started early for a flow that failed before it took them."""
        self.prepared = None
        engines = self.take_early_engines()
        if engines is not None:
            engines.close()


# The one table of live runs in this process, by run id: Prefect tasks receive only (run_id, step) and find their
# run here; the CLI and its flow share one entry. Process-global because a Prefect task cannot be handed an object.
_LIVE: dict[str, LiveRun] = {}


@contextlib.contextmanager
def open_run(cfg: RunConfig, command: str) -> Iterator[LiveRun]:
    """The run `cfg` names, live for the block: its lock (storage/run_lock.py) and the check of its tables
    (storage/integrity.py) taken first. Re-entered by the flow the CLI started: the CLI's entry is returned as is."""
    live = _LIVE.get(cfg.run_id)
    if live is not None:
        yield live
        return
    from sluiceway.storage.integrity import check_tables
    from sluiceway.storage.maintenance import RUN_TABLES

    run_dir = Path(cfg.storage.output_dir).resolve()
    store = ObjectStore.from_uri(cfg.tables_uri, cfg.storage.s3_endpoint_url, cfg.storage.s3_region)
    with run_lock.hold(run_dir, store, cfg.run_id, command) as lock:
        check_tables(store, RUN_TABLES)  # a damaged table is one line, not a run on unreadable data
        live = LiveRun(cfg, command, run_dir, store, lock)
        _LIVE[cfg.run_id] = live
        try:
            yield live
        finally:
            del _LIVE[cfg.run_id]
            live.close()


def live(run_id: str, kind: type[T]) -> T:
    """The live objects of `run_id`'s flow; every stage gets them before it writes, so a run that lost its lease
    (storage/run_lock.py) stops here."""
    run = _LIVE.get(run_id)
    if run is None or not isinstance(run.state, kind):
        raise RuntimeError(f"run {run_id} has no live {kind.__name__} in this process")
    run.lock.ensure_held()
    return run.state
