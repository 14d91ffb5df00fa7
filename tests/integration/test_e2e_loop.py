"""The whole loop on tiny-llama through the real CLI and Prefect: Delta rows, rewards, versions, learning."""

import json
import os
import shutil
import subprocess
import sys

import pandas as pd
import polars as pl
import pytest
import torch
from cli_run import BATCH, N, run_cli

from sluiceway.models.hf_megatron import hf_to_megatron
from sluiceway.models.zoo import load_hf_model, resolve_checkpoint
from sluiceway.storage.evals import read_evals
from sluiceway.storage.metrics import read_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import TRAJECTORY_SCHEMA, read_trajectories


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, warm_cache):
    """A 2-step run with evaluation, in a copy of the session's warm cache (first use on an empty cache is
    test_adaptive_difficulty_over_an_environment_mixture's)."""
    base = tmp_path_factory.mktemp("e2e")
    run_dir, cache = base / "run", base / "cache"
    shutil.copytree(warm_cache, cache)
    proc = run_cli(
        run_dir,
        cache,
        "--num-rollout",
        "2",
        "--eval-interval",
        "2",
        "--eval-prompt-data",
        "arith",
        "env:arithmetic",
        "--eval-size",
        "4",
        "--n-samples-per-eval-prompt",
        "2",
        "--eval-temperature",  # greedy evaluation, shorter than the rollout's responses
        "0",
        "--eval-max-response-len",
        "6",
    )
    return run_dir, cache, proc


def test_trajectories_are_in_delta(finished_run):
    run_dir, _, proc = finished_run
    assert "step   1/2  reward" in proc.stdout and "step   2/2  reward" in proc.stdout
    store = ObjectStore.from_uri(str(run_dir / "tables"))
    table = read_trajectories(store, "run")
    assert table.num_rows == 2 * BATCH * N
    assert table.schema.equals(TRAJECTORY_SCHEMA, check_metadata=False) or set(table.schema.names) == set(
        TRAJECTORY_SCHEMA.names
    )
    rows = table.to_pylist()
    assert all(r["reward"] is not None and 0.0 <= r["reward"] <= 1.0 for r in rows)
    assert all(len(r["rollout_logprobs"]) == len(r["response_token_ids"]) == len(r["loss_mask"]) for r in rows)
    assert {(r["step"], r["weight_version"]) for r in rows} == {(0, 0), (1, 1)}
    assert len({(r["step"], r["group_id"], r["sample_index"]) for r in rows}) == len(rows)


def test_tables_read_with_polars_and_pandas(finished_run):
    run_dir, _, _ = finished_run
    uri = str(run_dir / "tables" / "trajectories")
    df = pl.read_delta(uri)
    assert df.height == 2 * BATCH * N and "response_text" in df.columns
    from deltalake import DeltaTable

    pdf = DeltaTable(uri).to_pandas()
    assert isinstance(pdf, pd.DataFrame) and len(pdf) == 2 * BATCH * N


def test_metrics_per_step(finished_run):
    run_dir, _, _ = finished_run
    m = read_metrics(ObjectStore.from_uri(str(run_dir / "tables")), "run").to_pylist()
    steps = {r["step"] for r in m if r["name"] == "reward_mean"}
    assert steps == {0, 1}
    assert {r["value"] for r in m if r["name"] == "weight_version"} == {1.0, 2.0}


def test_evaluation_before_and_after_training(finished_run):
    run_dir, _, proc = finished_run
    assert "eval after   0 steps" in proc.stdout and "eval after   2 steps" in proc.stdout
    m = read_metrics(ObjectStore.from_uri(str(run_dir / "tables")), "run").to_pylist()
    evals = {r["step"]: r["value"] for r in m if r["name"] == "eval/arith/pass@2"}
    assert set(evals) == {0, 2} and all(0.0 <= v <= 1.0 for v in evals.values())
    assert {r["value"] for r in m if r["name"] == "eval/arith/prompts"} == {4.0}


def test_evaluation_samples_are_in_the_evals_table(finished_run):
    run_dir, _, _ = finished_run
    store = ObjectStore.from_uri(str(run_dir / "tables"))
    rows = read_evals(store, "run").to_pylist()
    assert [(r["step"], r["prompt_index"], r["sample_index"]) for r in rows] == [
        (step, g, i) for step in (0, 2) for g in range(4) for i in range(2)
    ]
    # The eval's own sampling settings, not the rollout's (temperature 1.0, 8 tokens).
    assert {(r["temperature"], r["top_p"], r["max_new_tokens"]) for r in rows} == {(0.0, 1.0, 6)}
    assert all(len(r["response_token_ids"]) <= 6 and r["eval_set"] == "arith" for r in rows)
    assert {(r["step"], r["weight_version"]) for r in rows} == {(0, 0), (2, 2)}  # evaluated after 0 and 2 steps
    for step in (0, 2):
        answers = [r["response_token_ids"] for r in rows if r["step"] == step]
        assert answers[0::2] == answers[1::2]  # greedy: a prompt's two samples agree
    m = read_metrics(store, "run").to_pylist()
    for step in (0, 2):
        stored = [r["reward"] for r in rows if r["step"] == step]
        [mean] = [r["value"] for r in m if r["name"] == "eval/arith/reward_mean" and r["step"] == step]
        assert mean == pytest.approx(sum(stored) / len(stored))
    assert pl.read_delta(str(run_dir / "tables" / "evals")).height == len(rows)


def test_policy_weights_changed(finished_run):
    run_dir, cache, _ = finished_run
    hf_dir = resolve_checkpoint("tiny-llama", cache_dir=cache)
    hf = load_hf_model(hf_dir)
    initial = hf_to_megatron(hf.state_dict(), hf.config)
    trained = torch.load(run_dir / "checkpoints" / "latest" / "tp0.pt", weights_only=False)
    assert trained["weight_version"] == 2 and trained["step"] == 1
    changed = [k for k, v in initial.items() if not torch.equal(v, trained["model"][k])]
    assert len(changed) >= len(initial) // 2, f"only {len(changed)} of {len(initial)} tensors changed"


@pytest.mark.shared_prefect  # the resume reads the run's tables and checkpoint: tests/integration/conftest.py
def test_rerun_resumes_from_checkpoint_and_table(finished_run):
    run_dir, cache, _ = finished_run
    proc = run_cli(run_dir, cache, "--num-rollout", "3")
    assert "step   1/3" not in proc.stdout and "step   3/3  reward" in proc.stdout
    table = read_trajectories(ObjectStore.from_uri(str(run_dir / "tables")), "run")
    assert table.num_rows == 3 * BATCH * N  # steps 0 and 1 were not generated again
    assert set(table.column("weight_version").to_pylist()) == {0, 1, 2}


@pytest.mark.slow  # minutes on 2 cores; `make test-all` runs it
def test_loop_with_a_torchrun_trainer_group(tmp_path):
    """TP=2 over two gloo ranks: one group serves every step of the run, checkpoints, and a re-run resumes."""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    group = ("--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2")
    proc = run_cli(run_dir, cache, "--num-rollout", "2", *group)
    assert "step   2/2  reward" in proc.stdout
    log = (run_dir / "trainer" / "trainer.log").read_text()
    assert log.count("trainer group ready: 2 ranks, tensor parallel 2") == 1  # built once, not per step
    assert sorted(p.name for p in (run_dir / "checkpoints" / "latest").iterdir()) == ["meta.json", "tp0.pt", "tp1.pt"]
    proc = run_cli(run_dir, cache, "--num-rollout", "3", *group)
    assert "step   2/3" not in proc.stdout and "step   3/3  reward" in proc.stdout
    meta = json.loads((run_dir / "checkpoints" / "latest" / "meta.json").read_text())
    assert sorted(meta.pop("files")) == ["tp0.pt", "tp1.pt"]  # each file's size and sha256, checked on load
    assert meta == {"step": 2, "weight_version": 3, "tensor_parallel": 2}


def test_tables_on_s3(tmp_path, s3_server):
    """--storage-uri s3://...: the same run with its tables on a real S3 server; credentials from the env."""
    uri = f"s3://{s3_server.bucket}/e2e-run"
    proc = run_cli(
        tmp_path / "run", tmp_path / "cache", "--num-rollout", "1", "--storage-uri", uri, env=s3_server.env()
    )
    assert "step   1/1  reward" in proc.stdout
    assert s3_server.secret_key not in proc.stdout + proc.stderr
    assert not (tmp_path / "run" / "tables").exists()
    old = {k: os.environ.get(k) for k in s3_server.env()}
    os.environ.update(s3_server.env())
    try:
        table = read_trajectories(ObjectStore.from_uri(uri), "run")
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    assert table.num_rows == BATCH * N
    # Prefect's record of the flow run holds the config, never the credentials.
    db = (tmp_path / "run" / "prefect" / "prefect.db").read_bytes()
    assert s3_server.secret_key.encode() not in db and s3_server.access_key.encode() not in db


@pytest.mark.cold_cache  # it checks the first-use build of tiny-llama
def test_adaptive_difficulty_over_an_environment_mixture(tmp_path):
    """Prompts made per step by the curriculum, scored by each environment's own verifier (--rm-type env)."""
    run_dir = tmp_path / "run"
    args = [
        sys.executable, "-m", "sluiceway.flows.cli", "run", "--prompt-data", "env:mix(arithmetic=1,reverse=1)",
        "--adaptive-difficulty", "--rm-type", "env", "--hf-checkpoint", "tiny-llama", "--output-dir", str(run_dir),
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8",
        "--micro-batch-size", "8", "--rollout-max-response-len", "6", "--num-rollout", "2",
    ]  # fmt: skip
    proc = subprocess.run(
        args, capture_output=True, text=True, timeout=600, env=dict(os.environ, SLUICEWAY_CACHE=str(tmp_path / "cache"))
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # A fresh cache: tiny-llama is built on first use, quietly (no third-party progress bar), and said once in the log.
    assert "Writing model shards" not in proc.stderr and "it/s]" not in proc.stderr, proc.stderr
    assert (run_dir / "sluiceway.log").read_text().count("built tiny-llama (first use)") == 1
    rows = read_trajectories(ObjectStore.from_uri(str(run_dir / "tables")), "run").to_pylist()
    metas = [json.loads(r["metadata"]) for r in rows]
    assert {m["env"] for m in metas} == {"arithmetic", "reverse"} and all(m["level"] == 1 for m in metas)
    assert all(r["reward"] is not None for r in rows)  # each routed to its environment's verifier
    assert json.loads((run_dir / "curriculum.json").read_text())["last_observed_step"] == 1
    m = read_metrics(ObjectStore.from_uri(str(run_dir / "tables")), "run").to_pylist()
    assert {r["step"] for r in m if r["name"] == "difficulty/reverse"} == {0, 1}
