"""The nullable teacher_logprobs column (on-policy distillation): stored and read back; a table written before the
column existed stays readable at every version, takes new rows, updates and compaction (schema evolution)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from deltalake import write_deltalake
from storage_helpers import batch

from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.tables import TABLE_PROPERTIES, open_table, table_schema
from sluiceway.storage.trajectories import (
    PARTITION_BY,
    TRAJECTORIES,
    TRAJECTORY_SCHEMA,
    _rows_to_table,
    append_trajectories,
    compact_steps,
    read_trajectories,
    set_rewards,
    set_teacher_logprobs,
)

OLD_SCHEMA = pa.schema([f for f in TRAJECTORY_SCHEMA if f.name != "teacher_logprobs"])


def test_teacher_logprobs_round_trip(tmp_path):
    store = ObjectStore.from_uri(str(tmp_path / "t"))
    append_trajectories(store, batch(0), "a/0")
    t = read_trajectories(store, "run-a", 0)
    assert t.column("teacher_logprobs").null_count == t.num_rows  # nothing scored yet
    scored = [(g, i, [-0.25] * (2 + i)) for g, i in zip(t.column("group_id").to_pylist(),
                                                        t.column("sample_index").to_pylist())]  # fmt: skip
    assert set_teacher_logprobs(store, "run-a", 0, scored) == 4
    assert set_teacher_logprobs(store, "run-a", 0, scored) == 0  # the same values: no commit
    rows = read_trajectories(store, "run-a", 0).to_pylist()
    assert [r["teacher_logprobs"] for r in rows] == [[-0.25] * (2 + r["sample_index"]) for r in rows]


def test_teacher_logprobs_length_checked(tmp_path):
    store = ObjectStore.from_uri(str(tmp_path / "t"))
    rows = batch(0)
    rows[0]["teacher_logprobs"] = [-1.0]  # 2 response tokens
    with pytest.raises(ValueError, match="teacher_logprobs"):
        append_trajectories(store, rows, "a/0")


def test_old_table_evolves(store):  # a local directory and S3 (conftest.py)
    old = _rows_to_table(batch(0)).select(OLD_SCHEMA.names).cast(OLD_SCHEMA)
    write_deltalake(store.table_uri(TRAJECTORIES), old, partition_by=PARTITION_BY, configuration=TABLE_PROPERTIES,
                    storage_options=store.storage_options)  # fmt: skip
    assert "teacher_logprobs" not in table_schema(open_table(store, TRAJECTORIES)).names
    t = read_trajectories(store, "run-a", 0)  # read before any write: nulls
    assert t.schema.equals(TRAJECTORY_SCHEMA) and t.column("teacher_logprobs").null_count == 4
    set_rewards(store, "run-a", 0, [(0, 0, 1.0, None)])  # an update (resume of an old run) evolves the table
    assert "teacher_logprobs" in table_schema(open_table(store, TRAJECTORIES)).names
    append_trajectories(store, batch(1), "a/1")
    set_teacher_logprobs(store, "run-a", 1, [(0, 0, [-0.5, -0.5])])
    assert read_trajectories(store, "run-a", 1).to_pylist()[0]["teacher_logprobs"] == [-0.5, -0.5]
    v0 = read_trajectories(store, "run-a", version=0)  # time travel to the version without the column
    assert v0.num_rows == 4 and v0.column("teacher_logprobs").null_count == 4
    compact_steps(store, "run-a", done_before=2, block_steps=2)
    everything = read_trajectories(store, "run-a")
    assert everything.num_rows == 8
    assert [r["teacher_logprobs"] for r in everything.to_pylist() if r["step"] == 1][0] == [-0.5, -0.5]
