"""Groups that finish together share one Delta commit, and each stays idempotent by its own app id."""

import asyncio

from storage_helpers import batch

from sluiceway.storage.tables import table_version
from sluiceway.storage.trajectories import TRAJECTORIES, append_trajectory_groups, read_trajectories
from sluiceway.tasks.rollout.writer import GroupWriter


def test_several_groups_one_commit_each_idempotent(store):
    assert append_trajectory_groups(store, [(batch(0, groups=(0,)), "r/0/0")]) == [True]
    v = table_version(store, TRAJECTORIES)
    groups = [(batch(0, groups=(g,)), f"r/0/{g}") for g in (0, 1, 2)]
    assert append_trajectory_groups(store, groups) == [False, True, True]  # group 0 was stored already
    assert table_version(store, TRAJECTORIES) == v + 1  # one commit for both new groups
    assert append_trajectory_groups(store, groups) == [False, False, False]
    assert table_version(store, TRAJECTORIES) == v + 1  # nothing new: no commit
    assert sorted(set(read_trajectories(store, "run-a", 0).column("group_id").to_pylist())) == [0, 1, 2]


def test_writer_batches_groups_finishing_together(store):
    async def finish_all():
        writer = GroupWriter(store)
        new = await asyncio.gather(*(writer.write(batch(1, groups=(g,)), f"w/1/{g}") for g in range(6)))
        return writer, new

    writer, new = asyncio.run(finish_all())
    assert new == [True] * 6
    assert writer.commits < 6  # the first commit ran alone; the five queued meanwhile went together
    assert read_trajectories(store, "run-a", 1).num_rows == 6 * 2
