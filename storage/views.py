"""In-memory views of small append-only tables, kept current by reading only the files added since.

The stage ledger is asked "is this stage of this step finished?" several times a step. Scanning the run's
ledger for the answer costs more with every step recorded; a view reads each data file of the partition
once, when it first appears in the log, and answers from memory. A file that compaction writes holds rows
the view has seen already: they are read once more and change nothing (ledger rows never change).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sluiceway.storage import handles


class NewRows:
    """Rows of one partition (``{"run_id": ...}``) as its data files appear in the table's log."""

    def __init__(self, handle: handles.Handle, partition: dict[str, str], columns: list[str]) -> None:
        self.handle = handle
        self.partition = partition
        self.columns = columns
        self.version: int | None = None
        self.seen: set[str] = set()

    def poll(self) -> list[pa.Table]:
        """The rows of the partition's files not seen before (none when the table has not moved).

        The new files come from the snapshot's add actions (an Arrow table in memory), not from a dataset of
        every file of the partition: that would cost more with every file written since the last compaction.
        """
        h = self.handle
        with h.lock, h.store.redacting():
            dt = h.latest()
            if dt.version() == self.version:
                return []
            actions = pa.table(dt.get_add_actions(flatten=True))  # arro3 -> pyarrow, zero-copy
            mask = None
            for key, value in self.partition.items():
                match = pc.equal(actions.column(f"partition.{key}"), value)
                mask = match if mask is None else pc.and_(mask, match)
            paths = actions.filter(mask).column("path").to_pylist()
            fresh = [p for p in paths if p not in self.seen]
            fs = h.store.filesystem() if fresh else None
            root = h.store.table_uri(h.name).removeprefix("s3://")
            # Delta stores the path URL-encoded and relative to the table; the partition columns are not in it.
            tables = [pq.read_table(f"{root}/{unquote(p)}", columns=self.columns, filesystem=fs) for p in fresh]
            self.seen = set(paths)  # the partition's files now: a compacted-away path never comes back
            self.version = dt.version()
        return tables


def partition_view(handle: handles.Handle, kind: str, partition: dict[str, str], build) -> Any:
    """The view `build(handle, partition)` kept on `handle` under (kind, partition), made on first use."""
    key = (kind, tuple(sorted(partition.items())))
    view = handle.views.get(key)
    if view is None:
        view = handle.views[key] = build(handle, partition)
    return view
