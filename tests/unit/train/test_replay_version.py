"""`resolve_version`: which trajectories-table version a replay reads for a version, a timestamp, or neither."""

from __future__ import annotations

import datetime as dt
import os

import pytest
from storage_helpers import batch

from sluiceway.infra.errors import UserError
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.tables import open_table
from sluiceway.storage.trajectories import TRAJECTORIES, append_trajectories
from sluiceway.tasks.train.replay import resolve_version


def at(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC)


@pytest.fixture
def store(tmp_path):
    store = ObjectStore(str(tmp_path / "tables"))
    for step in range(3):
        assert append_trajectories(store, batch(step), app_id=f"step-{step}")
    return store


def test_a_commits_own_timestamp_reads_that_commit_even_when_its_log_file_is_written_later(store, tmp_path):
    history = {h["version"]: h["timestamp"] for h in open_table(store, TRAJECTORIES).history()}
    assert sorted(history) == [0, 1, 2]
    # On a loaded machine a commit's log file can be written a few milliseconds after the timestamp the commit
    # records; make that happen to every commit (deltalake's own load_as_version(datetime) then answers the
    # version before, which is what failed in CI).
    log = tmp_path / "tables" / TRAJECTORIES / "_delta_log"
    for version, when in history.items():
        late = (when + 5) * 1_000_000
        os.utime(log / f"{version:020d}.json", ns=(late, late))
    for version, when in history.items():
        assert resolve_version(store, timestamp=at(when)) == version
    assert resolve_version(store, timestamp=at(history[2] + 60_000)) == 2
    assert resolve_version(store, timestamp=at(history[1]).replace(tzinfo=None)) == 1  # naive means UTC
    assert resolve_version(store) == 2 and resolve_version(store, version=1) == 1


def test_times_and_versions_outside_the_table_are_one_line(store):
    first = min(h["timestamp"] for h in open_table(store, TRAJECTORIES).history())
    with pytest.raises(UserError, match="before the first commit"):
        resolve_version(store, timestamp=at(first - 1))
    with pytest.raises(UserError, match="has versions up to 2"):
        resolve_version(store, version=7)
