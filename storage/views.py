"""In-memory views of small append-only tables, kept current by reading only the files added since.

The stage ledger is asked "is this stage of this step finished?" several times a step. Scanning the run's
ledger for the answer costs more with every step recorded; a view reads each data file of the partition
once, when it first appears in the log, and answers from memory. A file that compaction writes holds rows
the view has seen already: they are read once more and change nothing (ledger rows never change).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from sluiceway.storage import handles


class NewRows:
    """Rows of one partition (DNF `filters` on the partition columns) as its files appear in the table."""

    def __init__(self, handle: handles.Handle, filters: list[tuple[str, str, Any]]) -> None:
        self.handle = handle
        self.filters = filters
        self.version: int | None = None
        self.seen: set[str] = set()

    def poll(self) -> list[pa.Table]:
        """The rows of the partition's files not seen before (none when the table has not moved)."""
        h = self.handle
        with h.lock, h.store.redacting():
            dt = h.latest()
            if dt.version() == self.version:
                return []
            dataset = dt.to_pyarrow_dataset(file_pruning_predicate=self.filters)
            fresh = [f for f in dataset.get_fragments() if f.path not in self.seen]
            tables = [f.to_table(schema=dataset.schema) for f in fresh]
            self.seen.update(f.path for f in fresh)
            self.version = dt.version()
        return tables


def partition_view(handle: handles.Handle, kind: str, filters: list[tuple[str, str, Any]], build) -> Any:
    """The view `build(NewRows)` kept on `handle` under (kind, filters), made on first use."""
    key = (kind, tuple(filters))
    view = handle.views.get(key)
    if view is None:
        view = handle.views[key] = build(NewRows(handle, filters))
    return view
