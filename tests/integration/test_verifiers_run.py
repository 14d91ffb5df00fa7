"""Issue 43: a verifiers (v1) environment trains unchanged. tests/data/verifiers_envs/sw_add_v1 (written here
against verifiers 0.4.0's API: a taskset, a rubric of two weighted rewards and a metric, one MCP tool) played by
verifiers' own null harness, two steps of 1 prompt x 2 samples on tiny-llama through `sluiceway run
--prompt-data verifiers:sw_add_v1`. Every row is trained, its tokens turn by turn what the engine took in and gave
out (its request log), its reward the trace's weighted sum with the per-function scores beside it.

Runs under .venv-verifiers (make test's verifiers pass)."""

import json
import math
import os

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers runs under .venv-verifiers (make test's verifiers pass)")

from cli_run import run_cli  # noqa: E402
from paths import DATA  # noqa: E402
from test_agent_harnesses import check_row_against_engine  # noqa: E402

from sluiceway.storage.metrics import read_metrics  # noqa: E402
from sluiceway.storage.object_store import ObjectStore  # noqa: E402
from sluiceway.storage.trajectories import is_trainable, read_trajectories  # noqa: E402

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py

ENVS = DATA / "verifiers_envs"


def test_a_verifiers_environment_trains_two_steps_with_the_engines_tokens(tmp_path):
    run_dir, cache, log = tmp_path / "run", tmp_path / "cache", tmp_path / "engine_requests.jsonl"
    env_args = {"taskset": {"num_tasks": 4}, "agent": {"harness": {"id": "null"}}}
    pythonpath = os.pathsep.join([str(ENVS), *filter(None, [os.environ.get("PYTHONPATH")])])
    run_cli(run_dir, cache, "--num-rollout", "2", "--prompt-data", "verifiers:sw_add_v1",
            "--verifiers-env", json.dumps(env_args), "--rollout-max-response-len", "48",
            "--rollout-max-prompt-len", "384", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2",
            "--global-batch-size", "2", "--micro-batch-size", "2",
            env={"SLUICEWAY_ENGINE_REQUEST_LOG": str(log), "PYTHONPATH": pythonpath})  # fmt: skip
    engine_log = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        engine_log[rec["rid"]] = rec
    store = ObjectStore.from_uri(str(run_dir / "tables"))
    for step in (0, 1):
        rows = read_trajectories(store, "run", step).to_pylist()
        assert len(rows) == 2 and all(is_trainable(r) for r in rows), [r["metadata"] for r in rows]
        for r in rows:
            d = json.loads(r["reward_details"])
            assert d["source"] == "verifiers" and d["env"] == "sw_add_v1", d
            assert set(d["rewards"]) == {"correct", "used_tool"} and set(d["metrics"]) == {"turns"}
            weighted = sum(v["score"] * v["weight"] for v in d["rewards"].values())
            assert r["reward"] == pytest.approx(weighted)
            meta = json.loads(r["metadata"])["verifiers"]
            assert meta["trace_id"] == d["trace_id"] and isinstance(meta["idx"], int)
            assert "add_toolset_add" in r["prompt"]  # the harness's own prompt, with the environment's tool
            assert check_row_against_engine(r, engine_log, step) == d["turns"]
    for f in run_dir.rglob("*"):  # the sessions' keys went to verifiers' client only
        assert not f.is_file() or b"sk-sluiceway-" not in f.read_bytes(), f
    m = read_metrics(store, "run").to_pylist()
    losses = {r["step"]: r["value"] for r in m if r["name"] == "train/loss"}
    assert set(losses) == {0, 1} and all(math.isfinite(v) for v in losses.values())
