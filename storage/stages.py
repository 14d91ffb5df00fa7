"""The stage ledger: which stages of which step of a run finished, and what they returned.

A stage task records its small JSON result here, keyed by (run id, step, stage), once it has finished; a run
started again with the same run id returns the recorded result instead of running the stage, so it starts at
the first unfinished stage. The stages' real output (trajectories, rewards, filter decisions) is in the other
tables already; the ledger is what says a stage is complete. Training and weight sync are not in the ledger:
the checkpoint says how far training got.
"""

from __future__ import annotations

import datetime as _dt
import json
import threading
from typing import Any

import pyarrow as pa

from sluiceway.storage import handles
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.tables import append_idempotent, table_exists
from sluiceway.storage.views import NewRows, partition_view

STAGES = "stages"

STAGES_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("stage", pa.string(), nullable=False),
        pa.field("result", pa.string(), nullable=False),  # JSON
        pa.field("finished_at", pa.timestamp("us", tz="UTC"), nullable=False),
    ]
)


def record_stage(store: ObjectStore, run_id: str, step: int, stage: str, result: dict[str, Any]) -> bool:
    """Mark (run_id, step, stage) finished with `result`; False if it was recorded already (a re-run)."""
    row = {
        "run_id": [run_id],
        "step": [int(step)],
        "stage": [stage],
        "result": [json.dumps(result, sort_keys=True, default=float)],
        "finished_at": [_dt.datetime.now(_dt.UTC)],
    }
    table = pa.table(row, schema=STAGES_SCHEMA)
    return append_idempotent(store, STAGES, table, app_id=f"stage/{run_id}/{step}/{stage}", partition_by=["run_id"])


class _Ledger:
    """One run's ledger in memory: (step, stage) -> result JSON, advanced with each new ledger file."""

    def __init__(self, handle: handles.Handle, partition: dict[str, str]) -> None:
        self.rows = NewRows(handle, partition, ["step", "stage", "result"])
        self.results: dict[tuple[int, str], str] = {}
        self.lock = threading.Lock()

    def current(self) -> dict[tuple[int, str], str]:
        with self.lock:
            for t in self.rows.poll():
                cols = t.to_pydict()
                self.results.update(zip(zip(cols["step"], cols["stage"], strict=True), cols["result"], strict=True))
            return self.results


def _ledger(store: ObjectStore, run_id: str) -> _Ledger:
    return partition_view(handles.handle(store, STAGES), "ledger", {"run_id": run_id}, _Ledger)


def finished_stage(store: ObjectStore, run_id: str, step: int, stage: str) -> dict[str, Any] | None:
    """The recorded result of a finished stage, or None if it has not finished."""
    if not table_exists(store, STAGES):
        return None
    result = _ledger(store, run_id).current().get((int(step), stage))
    return None if result is None else json.loads(result)


def finished_stages(store: ObjectStore, run_id: str) -> list[tuple[int, str]]:
    """(step, stage) of every finished stage of the run, in step order."""
    if not table_exists(store, STAGES):
        return []
    return sorted(_ledger(store, run_id).current())
