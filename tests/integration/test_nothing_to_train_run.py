"""Issue 52 points 1 and 8 through `sluiceway run` and `sluiceway resume`, with the real engines and router: a step
with nothing to train stops the run with its cause, a resume generates it again and trains it; a generate
function that returns None, never returns or returns a million tokens costs only that sample
(tests/data/misbehaving_generate.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from cli_run import BATCH, N, cli_args
from paths import ROOT

from sluiceway.storage.metrics import read_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import RETRIED, read_trajectories
from sluiceway.tasks.train.batch import trainable_rows

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py

GENERATE = f"{ROOT / 'tests' / 'data' / 'misbehaving_generate.py'}:generate"


def test_a_step_with_nothing_to_train_stops_then_resumes_and_a_bad_sample_costs_only_itself(tmp_path):
    run_dir, cache, broken = tmp_path / "run", tmp_path / "cache", tmp_path / "broken"
    broken.touch()
    env = dict(os.environ, SLUICEWAY_CACHE=str(cache), SLUICEWAY_TEST_BROKEN=str(broken))
    args = cli_args(run_dir, "--num-rollout", "3", "--custom-generate-function-path", GENERATE,
                    "--rollout-timeout-s", "3")  # fmt: skip
    first = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 1, first.stdout + first.stderr
    errors = [line for line in first.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "none of the 4 groups of step 0 has a sample to train" in errors[0], first.stderr
    assert "raised RuntimeError: the tool server is down" in errors[0] and "Traceback" not in first.stderr
    store = ObjectStore.from_uri(str(run_dir / "tables"))
    assert not read_metrics(store, "run").num_rows  # nothing trained

    broken.unlink()  # the cause fixed
    resumed = subprocess.run([sys.executable, "-m", "sluiceway.flows.cli", "resume", str(run_dir)],
                             capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    metrics = read_metrics(store, "run").to_pandas().pivot_table(index="step", columns="name", values="value")
    assert list(metrics.index) == [0, 1, 2]  # step 0 trained this time, then the others
    assert all(math.isfinite(x) for x in metrics["train/loss"]) and (metrics["samples_failed"] >= 1).all()

    step0 = read_trajectories(store, "run", 0).to_pylist()
    old = [r for r in step0 if r["group_id"] < BATCH]
    assert len(old) == BATCH * N and {r["filter_reason"] for r in old} == {RETRIED}  # kept for the record
    reasons = {}
    for step in range(3):
        rows = read_trajectories(store, "run", step).to_pylist()
        failed = [r for r in rows if r["status"] == "failed" and r["filter_reason"] != RETRIED]
        assert len(failed) == 1, [(r["group_id"], r["sample_index"], r["status"]) for r in rows]
        reasons[step] = json.loads(failed[0]["metadata"])["failure_reason"]
        trained = trainable_rows(read_trajectories(store, "run", step))
        assert (failed[0]["group_id"], failed[0]["sample_index"]) not in {
            (r["group_id"], r["sample_index"]) for r in trained
        }
        assert all(len(r["response_token_ids"]) <= 8 for r in trained)
    assert "returned NoneType" in reasons[0]
    assert "did not return within 3 s" in reasons[1]
    assert "returned 1000000 response tokens" in reasons[2]
