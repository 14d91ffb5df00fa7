"""On-policy distillation on tiny models (`--use-opd --opd-type sglang`): with a task reward that is always 0 (pure
distillation) the student's per-token reverse KL to the teacher falls over 8 steps; the teacher, an engine this
test runs and counts, is asked once per sample, and neither a resume from the stored tables nor a replay asks it
again (they read the trajectories' teacher_logprobs column)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest
import torch
from cli_run import BATCH, N, run_cli
from paths import DATA
from safetensors.torch import save_file

from sluiceway.infra.engine_group import EngineGroup
from sluiceway.models.zoo import load_hf_model, load_hf_state_dict, resolve_checkpoint
from sluiceway.storage.metrics import read_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import read_trajectories

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning"),
    pytest.mark.shared_prefect,  # its runs use the worker's Prefect server: tests/integration/conftest.py
]

STEPS = 8
ZERO = str(DATA / "zero_rewards.py") + ":zero"
TOKEN = 300  # the token the teacher prefers


def make_teacher(student, out):
    """The student's weights with an untied output layer whose row TOKEN leans along the mean final hidden state:
    the teacher puts about half its mass on TOKEN in any context (a target the student can reach in a few steps),
    and the rest as the student does. Same tokenizer and vocabulary."""
    hf = load_hf_model(student).eval()
    with torch.no_grad():
        ids = torch.randint(3, hf.config.vocab_size, (16, 48), generator=torch.Generator().manual_seed(0))
        mean = hf.model(ids).last_hidden_state.reshape(-1, hf.config.hidden_size).mean(0)
    shutil.copytree(student, out)
    sd = load_hf_state_dict(student)
    head = sd["model.embed_tokens.weight"].clone()
    head[TOKEN] += 8.0 * mean / mean.norm() ** 2
    save_file({k: v.contiguous() for k, v in {**sd, "lm_head.weight": head}.items()}, out / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    return out


def scored(url: str) -> int:
    """How many scoring requests the teacher engine has served."""
    return httpx.get(f"{url}/server_info", timeout=10, trust_env=False).json()["internal_states"][0]["scored_requests"]


def metric(run_dir, run_id: str, name: str) -> list[float]:
    m = read_metrics(ObjectStore.from_uri(str(run_dir / "tables")), run_id).to_pylist()
    return [r["value"] for r in sorted(m, key=lambda r: r["step"]) if r["name"] == name]


OPD = ["--custom-rm-path", ZERO, "--use-opd", "--rollout-max-response-len", "16", "--lr", "1e-2",
       "--precision", "fp32"]  # fmt: skip


def test_pure_distillation_reverse_kl_falls_and_the_teacher_is_asked_once(tmp_path):
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    student = resolve_checkpoint("tiny-llama", cache_dir=cache)
    teacher_dir = make_teacher(student, tmp_path / "teacher")
    with EngineGroup(str(teacher_dir), 1, tmp_path / "teacher-logs", engine_args=("--max-total-len", "512")) as pool:
        url = pool.urls[0]
        run_cli(run_dir, cache, "--num-rollout", str(STEPS), "--opd-type", "sglang", "--opd-teacher-url", url, *OPD)
        store = ObjectStore.from_uri(str(run_dir / "tables"))
        rows = read_trajectories(store, "run").to_pylist()
        assert len(rows) == STEPS * BATCH * N
        for r in rows:  # every trained sample scored, over its response exactly
            assert r["teacher_logprobs"] is not None and len(r["teacher_logprobs"]) == len(r["response_token_ids"])
        asked = sum(1 for r in rows if r["response_token_ids"])
        assert scored(url) == asked  # once per sample
        assert sum(metric(run_dir, "run", "opd/teacher_requests")) == asked
        assert set(metric(run_dir, "run", "reward_mean")) == {0.0}  # pure distillation
        kl = metric(run_dir, "run", "opd/reverse_kl")
        assert len(kl) == STEPS
        print("opd/reverse_kl per step:", [round(k, 3) for k in kl])
        assert sum(kl[-3:]) / 3 < 0.8 * kl[0], kl

        # A resume that finds no checkpoint retrains every step from the tables: the ledger and the stored column
        # answer for the teacher, which is asked nothing.
        shutil.rmtree(run_dir / "checkpoints")
        shutil.rmtree(run_dir / "weights")
        run_cli(run_dir, cache, "--num-rollout", str(STEPS), "--opd-type", "sglang", "--opd-teacher-url", url, *OPD)
        assert scored(url) == asked
        # A replay trains on the stored teacher log-probs (and has no engine at all).
        replay = [
            sys.executable, "-m", "sluiceway.flows.cli", "replay", "--replay-run-id", "run",
            "--replay-tables", str(run_dir / "tables"), "--output-dir", str(tmp_path / "replay"),
            "--hf-checkpoint", "tiny-llama", "--rollout-temperature", "1.0", "--rollout-batch-size", str(BATCH),
            "--n-samples-per-prompt", str(N), "--global-batch-size", str(BATCH * N), "--micro-batch-size", "8",
            "--replay-steps", "0", "1", "--use-opd", "--opd-type", "sglang", "--lr", "1e-2", "--precision", "fp32",
        ]  # fmt: skip
        proc = subprocess.run(replay, capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, SLUICEWAY_CACHE=str(cache)))  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert scored(url) == asked
        replayed = metric(tmp_path / "replay", "replay", "opd/reverse_kl")
        assert len(replayed) == 2 and abs(replayed[0] - kl[0]) < 1e-3  # step 0 again, from the initial weights


@pytest.mark.slow  # 34 s; each teacher's scoring against the trainer's own is checked in tests/unit/train/test_opd.py
def test_megatron_teacher_and_a_teacher_the_run_serves_agree(tmp_path):
    """opd_type megatron (the teacher as a frozen megatron-core model in the trainer) and opd_type sglang with
    opd_teacher_load (an embedded teacher engine the run starts on loopback) score the same first samples (same
    seeds) alike: the first step's reverse KL is the same."""
    cache = tmp_path / "cache"
    teacher_dir = make_teacher(resolve_checkpoint("tiny-llama", cache_dir=cache), tmp_path / "teacher")
    mega, own = tmp_path / "mega", tmp_path / "own"
    run_cli(mega, cache, "--num-rollout", "1", "--opd-type", "megatron", "--opd-teacher-load", str(teacher_dir), *OPD)
    run_cli(own, cache, "--num-rollout", "1", "--opd-type", "sglang", "--opd-teacher-load", str(teacher_dir), *OPD)
    kl_mega, kl_own = metric(mega, "mega", "opd/reverse_kl"), metric(own, "own", "opd/reverse_kl")
    assert len(kl_mega) == len(kl_own) == 1 and kl_mega[0] > 1.0
    assert abs(kl_mega[0] - kl_own[0]) < 1e-3, (kl_mega, kl_own)
    assert metric(own, "own", "opd/teacher_requests") == [float(BATCH * N)]
    assert metric(mega, "mega", "opd/teacher_requests") == []  # no engine asked: the trainer holds the teacher
    assert (own / "logs" / "teacher" / "engine-0.log").exists()
