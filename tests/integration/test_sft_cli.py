"""`sluiceway sft` through the real CLI and Prefect: a bad record is one line naming file and line; end to end
(metrics, weights, resume)."""

import json
import os
import subprocess
import sys

import pytest

from sluiceway.models.zoo import load_hf_model, load_tokenizer, resolve_checkpoint
from sluiceway.storage.metrics import read_metrics
from sluiceway.storage.object_store import ObjectStore

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py

TWO_TURNS = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "The answer is 5."},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "8"},
]


@pytest.fixture
def tiny(tmp_path):
    """tiny-llama in the test's own cache, `tmp_path / "cache"`: a copy of the session's warm cache (tiny-llama built,
    the precision probe, the Prefect template database; tests/integration/conftest.py), not a build of its own."""
    cache = tmp_path / "cache"
    path = resolve_checkpoint("tiny-llama", cache_dir=cache)
    return path, load_tokenizer(path), cache


def sft_cli(*args, cache, cwd):
    env = dict(os.environ, SLUICEWAY_CACHE=str(cache))
    cmd = [sys.executable, "-m", "sluiceway.flows.cli", "sft", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)


def test_bad_record_is_one_line_naming_file_and_line(tiny, tmp_path):
    _, _, cache = tiny
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"input": TWO_TURNS}) + "\n" + json.dumps({"input": TWO_TURNS[:1]}) + "\n")
    proc = sft_cli("--prompt-data", str(data), "--output-dir", str(tmp_path / "run"), cache=cache, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and f"{data}:2" in err and "no assistant message" in err, err


def test_sft_cli_end_to_end_then_resume(tiny, tmp_path):
    _, _, cache = tiny
    data = tmp_path / "chats.jsonl"
    convs = [
        [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": f"It is {a + b}."}]
        for a, b in [(1, 2), (3, 4), (5, 1), (2, 2), (6, 3), (0, 7)]
    ]
    data.write_text("".join(json.dumps({"input": c}) + "\n" for c in convs))
    run_dir = tmp_path / "run"
    args = [
        "--prompt-data", str(data), "--output-dir", str(run_dir), "--hf-checkpoint", "tiny-llama",
        "--global-batch-size", "4", "--micro-batch-size", "2", "--num-epoch", "2", "--lr", "1e-2",
        "--save-interval", "2",
    ]  # fmt: skip
    proc = sft_cli(*args, cache=cache, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sft step    3/3" in proc.stdout and "done: 3 steps" in proc.stdout  # ceil(6 x 2 / 4)
    store = ObjectStore.from_uri(str(run_dir / "tables"))
    rows = read_metrics(store, "run").to_pylist()
    loss = {r["step"]: r["value"] for r in rows if r["name"] == "train/loss"}
    assert sorted(loss) == [0, 1, 2] and all(v > 0 for v in loss.values())
    assert {r["value"] for r in rows if r["name"] == "train/samples"} == {4.0}
    weights = run_dir / "weights" / "v000003"
    assert (weights / "model.safetensors").is_file() and (weights / "tokenizer_config.json").is_file()
    load_hf_model(weights)  # a complete HF model directory
    assert (run_dir / "checkpoints" / "latest").exists()
    # Run again: it resumes from the final checkpoint and has nothing left to train.
    again = sft_cli(*args, cache=cache, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "done: 0 steps (3 in the run" in again.stdout and "sft step" not in again.stdout
    assert len(read_metrics(store, "run")) == len(rows)


def test_sft_with_lora_writes_a_merged_model(tiny, tmp_path):
    """`sluiceway sft --lora-rank`: the adapters train and the final weights are an HF model with them merged."""
    import torch

    from sluiceway.models.zoo import load_hf_state_dict

    path, _, cache = tiny
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"input": TWO_TURNS}) + "\n" + json.dumps({"input": TWO_TURNS[:2]}) + "\n")
    run_dir = tmp_path / "run"
    args = [
        "--prompt-data", str(data), "--output-dir", str(run_dir), "--hf-checkpoint", "tiny-llama",
        "--global-batch-size", "2", "--micro-batch-size", "2", "--num-epoch", "3", "--lr", "1e-2",
        "--lora-rank", "4", "--target-modules", "q_proj", "v_proj",
    ]  # fmt: skip
    proc = sft_cli(*args, cache=cache, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    loss = {r["step"]: r["value"] for r in read_metrics(ObjectStore.from_uri(str(run_dir / "tables")), "run")
            .to_pylist() if r["name"] == "train/loss"}  # fmt: skip
    assert len(loss) == 3 and loss[2] < loss[0]
    merged, base = load_hf_state_dict(run_dir / "weights" / "v000003"), load_hf_state_dict(path)
    changed = {k for k in merged if not torch.equal(merged[k], base[k].to(merged[k].dtype))}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed)
    ckpt = torch.load(run_dir / "checkpoints" / "latest" / "tp0.pt", map_location="cpu", weights_only=False)
    assert all(k.endswith(("_A", "_B")) for k in ckpt["model"])
