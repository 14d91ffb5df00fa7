"""Durability and asynchrony of the RL flow through the real CLI on tiny-llama.

- A run SIGKILLed during the rollout of step 2 and resumed with `sluiceway resume` completes with every trajectory
  exactly once, and leaves no engine, router or trainer process behind.
- one-step-off: the rollout of step k+1 overlaps the training of step k in time (metrics timestamps), and no
  trained sample is more than one weight version old.
- Which failures Prefect retries.
"""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from cli_run import BATCH, SCORER, N, run_cli
from process_tags import processes_tagged

from sluiceway.storage.metrics import metrics_frame
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.stages import finished_stages
from sluiceway.storage.trajectories import read_trajectories

STEPS = 3


def cli(*args, env=None, timeout=600):
    env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "sluiceway.flows.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_sigkill_during_rollout_then_resume(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    args = [
        "run", "--prompt-data", "env:arithmetic", "--hf-checkpoint", "tiny-llama", "--output-dir", str(run_dir),
        "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N), "--global-batch-size", str(BATCH * N),
        "--micro-batch-size", "8", "--rollout-max-response-len", "24", "--rollout-temperature", "1.0",
        "--lr", "1e-3", "--save-interval", "1", "--env-size", "32", "--seed", "3", "--custom-rm-path", SCORER,
        "--num-rollout", str(STEPS), "--rollout-max-concurrency", "1",  # one request at a time: a long rollout
        "--maintenance-interval", "1",  # table upkeep after every step: the resume reads compacted tables
    ]  # fmt: skip
    env = dict(os.environ, SLUICEWAY_CACHE=str(cache))
    tag = f"killed-{uuid.uuid4().hex}"
    # Children inherit the environment: the tag finds them later, even re-parented.
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluiceway.flows.cli", *args],
        env=env | {"SLUICEWAY_TEST_TAG": tag},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    store = ObjectStore.from_uri(str(run_dir / "tables"))
    deadline = time.monotonic() + 300
    while True:  # kill once step 2 (index 1) has some groups stored but not all
        assert proc.poll() is None, proc.stdout.read()  # the run must not finish before the kill
        assert time.monotonic() < deadline, "step 2's rollout never started"
        if (run_dir / "tables" / "trajectories").exists():
            step1 = read_trajectories(store, "run", 1).num_rows
            if 0 < step1 < BATCH * N:
                break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = read_trajectories(store, "run", 1).num_rows
    assert 0 < killed_at < BATCH * N
    ledger = finished_stages(store, "run")
    assert {(0, "rollout"), (0, "reward"), (0, "filter")} <= set(ledger) and (1, "rollout") not in ledger

    resumed = cli("resume", str(run_dir), env={"SLUICEWAY_CACHE": str(cache)})
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "step   1/3" not in resumed.stdout  # step 1 was checkpointed: not trained again
    assert "step   2/3  reward" in resumed.stdout and "step   3/3  reward" in resumed.stdout
    table = read_trajectories(store, "run")
    keys = list(zip(*(table.column(c).to_pylist() for c in ("step", "group_id", "sample_index"))))
    assert len(keys) == len(set(keys)) == STEPS * BATCH * N  # nothing duplicated, nothing missing
    stages = [(k, s) for k in range(STEPS) for s in ("filter", "reward", "rollout")]
    assert finished_stages(store, "run") == stages  # every data stage finished exactly once
    trained = metrics_frame(store, "run")["train/loss"].dropna()
    assert list(trained.index) == [0, 1, 2]
    # The killed flow's engines, router and trainer went with it (parent-death signal).
    time.sleep(1)
    leftovers = processes_tagged(tag)
    assert not leftovers, f"processes of the killed run still alive: {leftovers}"


@pytest.mark.shared_prefect  # it reads the run's metrics only: tests/integration/conftest.py
def test_one_step_off_overlaps_rollout_and_training(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    # Rollouts of one request at a time and one sample per micro-batch: both stages last seconds, so whether they
    # overlap does not hinge on how fast a loaded machine starts a stage (a 0.3 s rollout could end before the
    # training it should overlap has even started).
    run_cli(
        run_dir, cache, "--num-rollout", str(STEPS), "--mode", "one-step-off", "--max-staleness", "1",
        "--micro-batch-size", "1", "--rollout-max-concurrency", "1", "--rollout-max-response-len", "24",
    )  # fmt: skip
    m = metrics_frame(ObjectStore.from_uri(str(run_dir / "tables")), "run")
    for k in range(STEPS - 1):
        train = (m.loc[k, "time/train_start"], m.loc[k, "time/train_end"])
        roll = (m.loc[k + 1, "time/rollout_start"], m.loc[k + 1, "time/rollout_end"])
        assert roll[0] < train[1] and train[0] < roll[1], f"step {k} training and step {k + 1} rollout are disjoint"
        assert m.loc[k + 1, "rollout/engine_version"] == k  # generated before training step k finished
    assert (m["rollout/staleness_max"] <= 1).all() and (m.loc[1:, "rollout/staleness_max"] == 1).all()
    assert (m["samples_filtered"] == 0).all()  # within the limit: nothing dropped as stale


@pytest.mark.slow  # minutes on 2 cores; `make test-all` runs it
def test_fully_async_stays_within_max_staleness(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    proc = run_cli(run_dir, cache, "--num-rollout", "4", "--mode", "fully-async", "--max-staleness", "2")
    assert "step   4/4  reward" in proc.stdout
    m = metrics_frame(ObjectStore.from_uri(str(run_dir / "tables")), "run")
    assert (m["rollout/staleness_max"] <= 2).all()
    # Generation ran ahead: some step's rollout began before the previous step's training ended.
    assert any(m.loc[k + 1, "time/rollout_start"] < m.loc[k, "time/train_end"] for k in range(3))


@pytest.mark.parametrize("ref", ["missing-run"])
def test_resume_of_an_unknown_run_is_one_line(tmp_path, ref):
    out = cli("resume", ref, "--runs-root", str(tmp_path))
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "no run 'missing-run'" in out.stderr
