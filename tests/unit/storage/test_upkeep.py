"""Long-lived table handles, the step cache, the in-memory stage ledger and table upkeep (storage/handles.py,
views.py, maintenance.py): every read still sees every commit, idempotency and the ledger survive compaction,
and time travel holds inside the replay retention and fails with one line outside it. Local disk and S3."""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake
from storage_helpers import batch

from sluiceway.infra.errors import UserError
from sluiceway.storage import handles
from sluiceway.storage.maintenance import maintain, maintain_run, maintain_table, retention_interval
from sluiceway.storage.metrics import METRICS, append_metrics, read_metrics
from sluiceway.storage.stages import STAGES, finished_stage, finished_stages, record_stage
from sluiceway.storage.tables import open_table, table_version
from sluiceway.storage.trajectories import (
    TRAJECTORIES,
    append_trajectories,
    append_trajectory_groups,
    compact_steps,
    read_trajectories,
    set_filter_reasons,
    set_rewards,
)
from sluiceway.tasks.train.replay import open_source

RUN = "run-a"


def other_process_append(store, rows: list[dict]) -> None:
    """A commit this process's handles did not make (another process writing the same table)."""
    table = read_trajectories(store, RUN, rows[0]["step"]).slice(0, 0)
    extra = pa.Table.from_pylist(rows, schema=table.schema)
    with store.redacting():
        write_deltalake(store.table_uri(TRAJECTORIES), extra, mode="append", storage_options=store.storage_options)


def fill(store, steps: int) -> None:
    """`steps` steps the way the flow writes them: groups, rewards, filter marks, ledger, metrics."""
    for step in range(steps):
        append_trajectory_groups(store, [(batch(step, groups=(g,)), f"rollout/{RUN}/{step}/{g}") for g in (0, 1)])
        record_stage(store, RUN, step, "rollout", {"groups": 2})
        set_rewards(store, RUN, step, [(g, i, float(g + i), None) for g in (0, 1) for i in (0, 1)])
        record_stage(store, RUN, step, "reward", {"scored": 4})
        set_filter_reasons(store, RUN, step, [(0, i, "zero_std") for i in (0, 1)])
        record_stage(store, RUN, step, "filter", {"kept": 2})
        append_metrics(store, RUN, step, {"reward_mean": float(step)})


def file_step_ranges(store) -> list[tuple[int, int]]:
    """(min step, max step) of every data file of the trajectories table, from the log's statistics."""
    actions = pa.table(open_table(store, TRAJECTORIES).get_add_actions(flatten=True))
    return sorted(zip(actions.column("min.step").to_pylist(), actions.column("max.step").to_pylist(), strict=True))


def test_reads_see_commits_made_by_others(store):
    append_trajectories(store, batch(0), app_id="b0")
    assert read_trajectories(store, RUN, 0).num_rows == 4  # opens the handle and fills the step cache
    row = read_trajectories(store, RUN, 0).to_pylist()[0] | {"group_id": 7}
    other_process_append(store, [row])
    assert sorted(set(read_trajectories(store, RUN, 0).column("group_id").to_pylist())) == [0, 1, 7]
    # the ledger, too: a record from elsewhere is seen by a view that was already open
    assert finished_stage(store, RUN, 0, "rollout") is None
    record_stage(store, RUN, 0, "rollout", {"n": 1})
    handles.forget(store, STAGES)  # as if another process had written it
    assert finished_stage(store, RUN, 0, "rollout") == {"n": 1}


def test_step_cache_serves_what_the_last_update_wrote(store):
    append_trajectories(store, batch(3), app_id="b3")
    read_trajectories(store, RUN, 3)
    assert set_rewards(store, RUN, 3, [(0, 0, 1.0, '{"ok": true}'), (1, 1, 0.5, None)]) == 2
    cached = read_trajectories(store, RUN, 3)
    handles.forget(store)  # a fresh process reads the table itself
    fresh = read_trajectories(store, RUN, 3)
    assert cached.equals(fresh)
    assert fresh.column("reward").to_pylist() == [1.0, None, None, 0.5]
    # the same update again changes nothing and commits nothing
    version = table_version(store, TRAJECTORIES)
    assert set_rewards(store, RUN, 3, [(0, 0, 1.0, '{"ok": true}')]) == 0
    assert table_version(store, TRAJECTORIES) == version
    with pytest.raises(ValueError, match=r"keys not stored .* e\.g\. \[\(5, 0\)\]"):
        set_rewards(store, RUN, 3, [(5, 0, 1.0, None)])


def test_idempotency_and_ledger_hold_after_upkeep(store):
    fill(store, 4)
    before = {s: read_trajectories(store, RUN, s) for s in range(4)}
    done = {u.table: u for u in maintain(store, [TRAJECTORIES, STAGES, METRICS], retention_hours=24)}
    assert done[STAGES].files_compacted >= 12  # a file per record became one
    assert len(open_table(store, STAGES).file_uris()) == 1
    for s in range(4):
        assert read_trajectories(store, RUN, s).equals(before[s])
    assert finished_stages(store, RUN) == sorted((s, st) for s in range(4) for st in ("filter", "reward", "rollout"))
    assert finished_stage(store, RUN, 2, "reward") == {"scored": 4}
    # a retried write after compaction is still recognised, for every kind of append
    assert append_trajectory_groups(store, [(batch(1, groups=(0,)), f"rollout/{RUN}/1/0")]) == [False]
    assert record_stage(store, RUN, 1, "filter", {"kept": 99}) is False
    assert append_metrics(store, RUN, 1, {"reward_mean": 5.0}) is False
    assert finished_stage(store, RUN, 1, "filter") == {"kept": 2}
    assert read_metrics(store, RUN).num_rows == 4
    handles.forget(store)
    assert finished_stage(store, RUN, 3, "filter") == {"kept": 2}  # from the compacted file alone


def test_replay_within_retention_after_upkeep(store):
    fill(store, 2)
    early = table_version(store, TRAJECTORIES)  # steps 0-1 done
    fill_more = [(batch(s, groups=(0, 1)), f"rollout/{RUN}/{s}/x") for s in (2, 3)]
    append_trajectory_groups(store, fill_more)
    set_rewards(store, RUN, 0, [(0, 0, 42.0, None)])  # rewrites a step the early version read
    maintain(store, [TRAJECTORIES, STAGES, METRICS], retention_hours=24)
    source = open_source(store, RUN, version=early)
    assert source.steps == [0, 1]
    rewards = read_trajectories(store, RUN, 0, version=early).column("reward").to_pylist()
    assert rewards == [0.0, 1.0, 1.0, 2.0]  # what that version held, not the later 42.0


def test_replay_outside_retention_is_one_line(store):
    fill(store, 2)
    early = table_version(store, TRAJECTORIES)
    for s in (2, 3):
        append_trajectory_groups(store, [(batch(s), f"rollout/{RUN}/{s}")])
    set_rewards(store, RUN, 0, [(0, 0, 42.0, None)])
    time.sleep(1.1)  # the log entries' times must lie before the cutoff
    upkeep = maintain_table(store, TRAJECTORIES, retention_hours=0)
    assert upkeep.files_vacuumed >= 1
    with pytest.raises(UserError) as err:
        open_source(store, RUN, version=early)
    line = str(err.value)
    assert "\n" not in line
    assert f"--replay-version {early}: no longer replayable" in line and "storage.retention_hours" in line
    assert open_source(store, RUN, steps=[0, 1]).version > early  # the latest always is readable


def test_retention_interval_rounds_up_and_rejects_negative():
    assert retention_interval(24) == "interval 86400 seconds"
    assert retention_interval(0.0001) == "interval 1 seconds"
    with pytest.raises(ValueError, match="retention_hours"):
        retention_interval(-1)


def test_handle_is_opened_once_and_advanced(store):
    append_trajectories(store, batch(0), app_id="b0")
    h = handles.handle(store, TRAJECTORIES)
    append_trajectories(store, batch(1), app_id="b1")
    assert handles.handle(store, TRAJECTORIES) is h
    assert isinstance(h.table, DeltaTable) and h.version == table_version(store, TRAJECTORIES)


def test_finished_steps_compact_into_blocks(store):
    fill(store, 7)
    early = table_version(store, TRAJECTORIES)
    before = {s: read_trajectories(store, RUN, s) for s in range(7)}
    files = len(open_table(store, TRAJECTORIES).file_uris())
    # blocks of 3 steps, steps 0-4 finished: block 0-2 only (3-5 is not complete)
    assert compact_steps(store, RUN, done_before=5, block_steps=3) == 3
    assert len(open_table(store, TRAJECTORIES).file_uris()) == files - 2
    assert compact_steps(store, RUN, done_before=5, block_steps=3) == 0  # done already: nothing to rewrite
    assert compact_steps(store, RUN, done_before=7, block_steps=3) == 3  # now 3-5 is complete
    handles.forget(store)
    for s in range(7):
        assert read_trajectories(store, RUN, s).equals(before[s]), s
    assert file_step_ranges(store) == [(0, 2), (3, 5), (6, 6)]
    if not store.is_s3:  # a block's file has one row group per step: a step is read without the others
        block = open_table(store, TRAJECTORIES).file_uris()
        assert sorted(pq.ParquetFile(u).metadata.num_row_groups for u in block) == [1, 3, 3]
    # later steps are still appended and rewritten on their own; retried appends are still recognised
    assert append_trajectory_groups(store, [(batch(1, groups=(0,)), f"rollout/{RUN}/1/0")]) == [False]
    assert set_rewards(store, RUN, 6, [(1, 1, 9.0, None)]) == 1
    assert read_trajectories(store, RUN, 4).equals(before[4])
    # and time travel to a version before the compaction reads what it held
    assert read_trajectories(store, RUN, 2, version=early).equals(before[2])
    assert open_source(store, RUN, version=early).steps == list(range(7))


def test_maintain_run_keeps_steps_in_flight_apart(store):
    fill(store, 3)
    append_trajectory_groups(store, [(batch(3, groups=(0,)), f"rollout/{RUN}/3/0")])  # step 3 in flight
    done = {u.table: u for u in maintain_run(store, RUN, done_before=3, retention_hours=24)}
    assert set(done) == {TRAJECTORIES, STAGES, METRICS}  # no evals table in this store
    # step 3's file is untouched (optimize would have binned it with the finished steps)
    assert (3, 3) in file_step_ranges(store)
    assert read_trajectories(store, RUN, 3).num_rows == 2
    append_trajectory_groups(store, [(batch(3, groups=(1,)), f"rollout/{RUN}/3/1")])
    assert read_trajectories(store, RUN, 3).num_rows == 4
