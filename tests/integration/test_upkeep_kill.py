"""Table upkeep killed part-way (SIGKILL, as a crash would) loses nothing: every step's rows, the stage
ledger and the metrics read as before, retried appends are still recognised, and the next upkeep finishes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from storage_helpers import batch

from sluiceway.storage import handles
from sluiceway.storage.maintenance import maintain_run
from sluiceway.storage.metrics import append_metrics, read_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.stages import STAGES, finished_stages, record_stage
from sluiceway.storage.tables import open_table
from sluiceway.storage.trajectories import TRAJECTORIES, append_trajectories, read_trajectories

RUN = "run-a"
STEPS = 12

# Upkeep in a child process, announcing when it starts and when it is done.
CHILD = """
import sys
from sluiceway.storage.maintenance import maintain_run
from sluiceway.storage.object_store import ObjectStore
store = ObjectStore.from_uri(sys.argv[1])
print("start", flush=True)
maintain_run(store, "run-a", done_before=int(sys.argv[2]), retention_hours=0, block_steps=4)
print("done", flush=True)
"""


def many_small_files(store: ObjectStore) -> None:
    for step in range(STEPS):
        for g in range(3):  # three files in the step's partition: compaction rewrites them
            append_trajectories(store, batch(step, groups=(g,)), app_id=f"rollout/{RUN}/{step}/{g}")
        for stage in ("rollout", "reward", "filter"):
            record_stage(store, RUN, step, stage, {"step": step, "stage": stage})
        append_metrics(store, RUN, step, {"reward_mean": step / 10})


def snapshot(store: ObjectStore) -> tuple:
    handles.forget(store)  # read as a fresh process would
    rows = tuple(read_trajectories(store, RUN, s).drop_columns(["created_at"]).to_pylist().__repr__()
                 for s in range(STEPS))
    return rows, tuple(finished_stages(store, RUN)), tuple(read_metrics(store, RUN).column("value").to_pylist())


def test_upkeep_killed_midway_loses_nothing(tmp_path):
    store = ObjectStore.from_uri(str(tmp_path / "store"))
    many_small_files(store)
    expected = snapshot(store)
    killed_midway = 0
    for delay in (0.05, 0.15, 0.3, 0.6, 1.0):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, store.root, str(STEPS)],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        assert child.stdout.readline().strip() == "start"
        time.sleep(delay)
        os.killpg(child.pid, signal.SIGKILL)
        out, _ = child.communicate()
        killed_midway += "done" not in out
        assert snapshot(store) == expected, f"killed {delay} s into upkeep"
        # new small files for the next round to compact
        for s in range(STEPS):
            append_trajectories(store, batch(s, groups=(9,)), app_id=f"extra/{delay}/{s}")
        expected = snapshot(store)
    assert killed_midway, "no kill landed while upkeep was running; make the tables bigger"
    # Retried writes are still recognised after the interrupted compactions ...
    assert append_trajectories(store, batch(3, groups=(1,)), app_id=f"rollout/{RUN}/3/1") is False
    assert record_stage(store, RUN, 5, "reward", {"other": True}) is False
    assert append_metrics(store, RUN, 7, {"reward_mean": 99.0}) is False
    # ... and the next upkeep finishes and leaves the same contents, in fewer files.
    done = {u.table: u for u in maintain_run(store, RUN, done_before=STEPS, retention_hours=0, block_steps=4)}
    assert done[TRAJECTORIES].files_compacted > 0  # the extra files of the last round
    assert snapshot(store) == expected
    assert len(open_table(store, TRAJECTORIES).file_uris()) == STEPS // 4
    assert len(open_table(store, STAGES).file_uris()) == 1
