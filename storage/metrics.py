"""Run metrics in long format: one row per (run, step, metric name).

Long format lets every stage log whatever metrics it has without a schema change; :func:`metrics_frame`
pivots to the wide step-by-metric table people plot. Writes are idempotent per (run_id, step, tag), so a
retried stage does not log its metrics twice.
"""

from __future__ import annotations

import datetime as _dt
from typing import TYPE_CHECKING

import pyarrow as pa

from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.tables import append_idempotent, read_table, table_exists

if TYPE_CHECKING:
    import pandas as pd

METRICS = "metrics"

METRICS_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("name", pa.string(), nullable=False),
        pa.field("value", pa.float64(), nullable=False),
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
    ]
)


def append_metrics(store: ObjectStore, run_id: str, step: int, metrics: dict[str, float], tag: str = "train") -> bool:
    """Log ``metrics`` for one step; False when this (run_id, step, tag) was logged already (or is empty).

    ``tag`` names the stage that logs (train, rollout, eval, ...) so stages logging at the same step do not
    suppress each other; metric names are stored as given (use prefixes like ``"rollout/reward_mean"``).
    """
    if not metrics:
        return False
    values = {}
    for name, value in metrics.items():
        try:
            values[str(name)] = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"metric {name!r} = {value!r} is not a number") from None
    now = _dt.datetime.now(_dt.UTC)
    n = len(values)
    table = pa.table(
        {
            "run_id": pa.array([run_id] * n, pa.string()),
            "step": pa.array([int(step)] * n, pa.int64()),
            "name": pa.array(list(values), pa.string()),
            "value": pa.array(list(values.values()), pa.float64()),
            "created_at": pa.array([now] * n, pa.timestamp("us", tz="UTC")),
        },
        schema=METRICS_SCHEMA,
    )
    return append_idempotent(
        store, METRICS, table, app_id=f"metrics:{run_id}:{int(step)}:{tag}", partition_by=["run_id"]
    )


def read_metrics(store: ObjectStore, run_id: str) -> pa.Table:
    """All metrics of ``run_id`` in long format, sorted by step, name, time."""
    if not table_exists(store, METRICS):
        return METRICS_SCHEMA.empty_table()
    table = read_table(store, METRICS, filters=[("run_id", "=", run_id)])
    return (
        table.select(METRICS_SCHEMA.names)
        .cast(METRICS_SCHEMA)
        .sort_by([("step", "ascending"), ("name", "ascending"), ("created_at", "ascending")])
    )


def metrics_frame(store: ObjectStore, run_id: str) -> pd.DataFrame:
    """A wide pandas DataFrame: index ``step``, one column per metric (the latest value if logged twice)."""
    long = read_metrics(store, run_id).to_pandas()
    if long.empty:
        import pandas as pd

        return pd.DataFrame(index=pd.Index([], name="step", dtype="int64"))
    # pivot (not pivot_table): a NaN loss is information and must stay visible.
    latest = long.sort_values("created_at", kind="stable").drop_duplicates(["step", "name"], keep="last")
    wide = latest.pivot(index="step", columns="name", values="value").sort_index()
    wide.columns.name = None
    return wide
