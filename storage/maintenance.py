"""Table upkeep: what keeps a table costing the same at step 3,000 as at step 3, and what it costs time travel.

Every commit adds a file to a table's `_delta_log`, and every small append adds a data file. Both are paid
for on every later commit: delta-rs lists the log on each commit (on a local disk that lists the whole
directory) and replays the files since the last checkpoint. `maintain_table` runs, in this order:

1. compaction: a partition's small files become one (`optimize.compact`: the stage ledger and metrics get
   a file per record), and a run's finished trajectory steps become one file per block of 100 steps
   (`storage/trajectories.compact_steps`, run by `maintain_run`);
2. `vacuum` (full): data files no version inside the retention reads;
3. a log checkpoint at the newest version, so opening or refreshing the table replays nothing older;
4. log cleanup (`cleanup_metadata`): log entries older than the retention, before a checkpoint.

**Replay retention.** A table version stays replayable (`sluiceway replay --replay-version V`, Delta time
travel) for `retention_hours` after the next version superseded it: its log entries and the data files it
read are kept that long. Older versions are gone after the next upkeep, and asking for one is a one-line
error (tasks/train/replay.py). The latest version is always readable. The retention is a table property
(`delta.logRetentionDuration`, `delta.deletedFileRetentionDuration`) set by the upkeep, so every Delta client
reading the table honours the same window.

Every step of upkeep is an ordinary Delta commit or a deletion of files no version inside the window reads,
so a process killed in the middle leaves the table as readable as before (at worst with unreferenced files
that the next vacuum removes).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from deltalake import DeltaTable

from sluiceway.storage.evals import EVALS
from sluiceway.storage.metrics import METRICS
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.stages import STAGES
from sluiceway.storage.tables import TABLE_PROPERTIES, WRITE_LOCK, open_table, table_exists
from sluiceway.storage.trajectories import STEP_BLOCK, TRAJECTORIES, compact_steps

# The tables a run writes step after step.
RUN_TABLES = [TRAJECTORIES, STAGES, METRICS, EVALS]

DEFAULT_RETENTION_HOURS = 24.0
# How long an idempotent append's id is remembered (storage.idempotency_hours).
DEFAULT_IDEMPOTENCY_HOURS = 1.0


@dataclass
class Upkeep:
    """What one table's upkeep did."""

    table: str
    version: int  # the version after upkeep
    files_compacted: int  # small files rewritten into bigger ones
    log_files_before: int | None  # entries in _delta_log before cleanup (None: not counted on this store)
    log_files_after: int | None
    files_vacuumed: int  # data files deleted
    seconds: float


def retention_interval(hours: float) -> str:
    """A Delta interval for `hours` (whole seconds, rounded up: never shorter than asked)."""
    if hours < 0 or math.isnan(hours):
        raise ValueError(f"retention_hours: {hours} is negative; expected hours >= 0")
    return f"interval {math.ceil(hours * 3600)} seconds"


def set_retention(dt: DeltaTable, hours: float, idempotency_hours: float = DEFAULT_IDEMPOTENCY_HOURS) -> bool:
    """Record the replay retention and the id window on the table (one commit, only when they changed)."""
    interval = retention_interval(hours)
    want = {
        "delta.logRetentionDuration": interval,
        "delta.deletedFileRetentionDuration": interval,
        # Every append looks its ids up and every checkpoint carries them: Delta forgets those older than this.
        "delta.setTransactionRetentionDuration": retention_interval(idempotency_hours),
        **TABLE_PROPERTIES,  # tables made before these existed get them here
    }
    have = dt.metadata().configuration
    if all(have.get(k) == v for k, v in want.items()):
        return False
    dt.alter.set_table_properties(want)
    return True


def maintain_table(
    store: ObjectStore,
    name: str,
    retention_hours: float = DEFAULT_RETENTION_HOURS,
    idempotency_hours: float = DEFAULT_IDEMPOTENCY_HOURS,
) -> Upkeep | None:
    """Compact, clean and checkpoint one table (see the module docstring); None if the table does not exist."""
    if not table_exists(store, name):
        return None
    t0 = time.perf_counter()
    # Writers of this process wait: compaction commits against the same partitions they append to.
    with WRITE_LOCK, store.redacting():
        dt = open_table(store, name)
        set_retention(dt, retention_hours, idempotency_hours)
        # A trajectories table holding many steps per partition is compacted by `compact_steps` only: optimize
        # would bin the steps still in flight with finished ones (a table with a partition per step is safe).
        binned = name == TRAJECTORIES and "step" not in dt.metadata().partition_columns
        compacted = {} if binned else dt.optimize.compact()
        # Full: every file no version inside the window reads, including those whose removal a checkpoint has
        # already forgotten (checkpoints drop expired removals; the log alone would leave those files behind).
        # Whole hours, rounded up, so a file is kept at least as long as the retention says.
        vacuumed = dt.vacuum(
            retention_hours=math.ceil(retention_hours), dry_run=False, enforce_retention_duration=False, full=True
        )
        dt.create_checkpoint()
        before = _log_entries(store, name)
        dt.cleanup_metadata()
        after = _log_entries(store, name)
        version = dt.version()
    return Upkeep(
        table=name,
        version=version,
        files_compacted=int(compacted.get("numFilesRemoved", 0)),
        log_files_before=before,
        log_files_after=after,
        files_vacuumed=len(vacuumed),
        seconds=time.perf_counter() - t0,
    )


def maintain(store: ObjectStore, names: list[str], retention_hours: float = DEFAULT_RETENTION_HOURS) -> list[Upkeep]:
    """`maintain_table` for each of `names` that exists."""
    return [u for u in (maintain_table(store, n, retention_hours) for n in names) if u is not None]


def maintain_run(
    store: ObjectStore,
    run_id: str,
    done_before: int,
    retention_hours: float = DEFAULT_RETENTION_HOURS,
    block_steps: int = STEP_BLOCK,
    idempotency_hours: float = DEFAULT_IDEMPOTENCY_HOURS,
) -> list[Upkeep]:
    """A run's upkeep after step ``done_before - 1`` finished: its finished trajectory steps compacted in blocks
    (`compact_steps`; `optimize` would bin the steps still in flight with old ones), then every table of the
    run compacted, cleaned and checkpointed."""
    t0 = time.perf_counter()
    replaced = compact_steps(store, run_id, done_before, block_steps)
    done = []
    for name in RUN_TABLES:
        upkeep = maintain_table(store, name, retention_hours, idempotency_hours)
        if upkeep is None:
            continue
        if name == TRAJECTORIES:
            upkeep.files_compacted = replaced
            upkeep.seconds = time.perf_counter() - t0
        done.append(upkeep)
    return done


def _log_entries(store: ObjectStore, name: str) -> int | None:
    if store.is_s3:
        return None  # a LIST of the whole log: the very cost upkeep avoids; not worth paying to report
    log = Path(store.table_uri(name)) / "_delta_log"
    return sum(1 for _ in log.iterdir()) if log.is_dir() else 0
