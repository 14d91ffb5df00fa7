"""Long-lived Delta table handles: one open `DeltaTable` per table per process, brought up to date incrementally.

Opening a Delta table lists its log, reads the last checkpoint and replays every commit since; a run makes
dozens of storage calls a step, and opening the table for each made every call cost more the longer the run
(docs/benchmarks.md, "Long-run storage cost"). A handle is opened once and advanced with
`update_incremental`, which reads only the commits made since its version, by this process or any other, so a
read through it still sees every committed write.

Writes made through the handle (`write_deltalake(handle, ...)`, `merge`, `optimize`, `vacuum`) advance it in
place. One lock per handle keeps a refresh and the read that follows it from interleaving with another thread's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from deltalake import DeltaTable

from sluiceway.storage.object_store import ObjectStore

# Enough for every table of a few stores at once (tests open many short-lived stores; the oldest go first).
MAX_HANDLES = 64

# A cache, per process on purpose: every ObjectStore made for the same table (a run's stages each make their own)
# shares one open handle, so that one replays the log and the others read the same state.
_lock = threading.Lock()
_handles: OrderedDict[tuple[str, tuple[tuple[str, str], ...]], Handle] = OrderedDict()


class Handle:
    """One open table. `latest()` brings it up to date; hold `lock` around a refresh and what reads from it."""

    def __init__(self, store: ObjectStore, name: str) -> None:
        self.store = store
        self.name = name
        self.lock = threading.RLock()
        # Caches other modules keep on this table (by their own key), living and dying with the handle.
        self.views: dict[str, Any] = {}
        with store.redacting():
            self.table = DeltaTable(store.table_uri(name), storage_options=store.storage_options)

    def latest(self) -> DeltaTable:
        """The table at its newest committed version (reads only the log entries after the handle's version)."""
        with self.lock, self.store.redacting():
            if not self._unchanged_on_disk():
                self.table.update_incremental()
        return self.table

    def _unchanged_on_disk(self) -> bool:
        """On a local disk: no commit after the handle's version (two stats instead of a listing).

        delta-rs lists the whole `_delta_log` directory to find new commits on a local disk (S3 lists from an
        offset), which costs more with every entry the retention keeps (docs/storage.md). Versions are
        contiguous, so no `{v+1}.json` means no newer version, provided `{v}.json` itself is still there (log
        clean-up removes entries oldest first; if ours is gone, newer ones may be too, and we list).
        """
        if self.store.is_s3:
            return False
        v = self.table.version()
        log = Path(self.store.table_uri(self.name)) / "_delta_log"
        return not (log / f"{v + 1:020d}.json").exists() and (log / f"{v:020d}.json").exists()

    @property
    def version(self) -> int:
        return self.table.version()


def _key(store: ObjectStore, name: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    # The options are part of the key: the same URI under other credentials or endpoint is another client.
    return store.table_uri(name), tuple(sorted((k, str(v)) for k, v in store.storage_options.items()))


def cached(store: ObjectStore, name: str) -> Handle | None:
    """The process's handle on `name` if one is open (no I/O)."""
    with _lock:
        h = _handles.get(_key(store, name))
        if h is not None:
            _handles.move_to_end(_key(store, name))
        return h


def handle(store: ObjectStore, name: str) -> Handle:
    """The process's handle on table `name`, opened on first use; raises TableNotFoundError if there is none.

    The handle is not refreshed here: call `latest()` for the newest version.
    """
    h = cached(store, name)
    if h is not None:
        return h
    fresh = Handle(store, name)  # opened outside the registry lock: on S3 this is several round trips
    with _lock:
        key = _key(store, name)
        h = _handles.setdefault(key, fresh)
        _handles.move_to_end(key)
        while len(_handles) > MAX_HANDLES:
            _handles.popitem(last=False)
    return h


def forget(store: ObjectStore, name: str | None = None) -> None:
    """Drop the handles on `name` (all of the store's tables when None): the next use opens the table anew.

    Needed only when a table is deleted or replaced underneath the process (a handle never goes backwards).
    """
    with _lock:
        if name:
            _handles.pop(_key(store, name), None)
            return
        prefix = store.root.rstrip("/") + "/"
        for key in [k for k in _handles if k[0].startswith(prefix)]:
            del _handles[key]
