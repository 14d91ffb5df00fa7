"""`sluiceway eval --eval-temperature 0` end to end: twice the same answers, and both stored."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from paths import DATA

from sluiceway.flows.report import render
from sluiceway.storage.evals import read_evals
from sluiceway.storage.metrics import read_metrics
from sluiceway.storage.object_store import ObjectStore

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning"),
    pytest.mark.shared_prefect,  # its runs use the worker's Prefect server: tests/integration/conftest.py
]

SCORER = str(DATA / "noise_rewards.py") + ":vowel_share"


# ------------------------------------------------------------------------------------------------ greedy sampling


# ------------------------------------------------------------------------------------------------ config


# ------------------------------------------------------------------------------------------------ the evals table


# ------------------------------------------------------------------------------------------------ end to end


def sluiceway_eval(cache, out, *extra):
    cmd = [
        sys.executable, "-m", "sluiceway.flows.cli", "eval", "--hf-checkpoint", "tiny-llama",
        "--eval-prompt-data", "arith", "env:arithmetic", "--eval-size", "3", "--n-samples-per-eval-prompt", "2",
        "--rollout-max-response-len", "20", "--custom-rm-path", SCORER, "--output-dir", str(out), *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, SLUICEWAY_CACHE=cache))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_greedy_eval_twice_gives_the_same_answers_and_stores_them(tmp_path):
    cache = str(tmp_path / "cache")
    flags = ("--eval-temperature", "0", "--eval-max-response-len", "6")
    runs = [sluiceway_eval(cache, tmp_path / name, *flags) for name in ("ev1", "ev2")]
    tables = [read_evals(ObjectStore.from_uri(str(tmp_path / name / "tables")), name) for name in ("ev1", "ev2")]
    for table in tables:
        assert table.num_rows == 3 * 2  # every sample: 3 prompts x 2
        assert set(table["temperature"].to_pylist()) == {0.0} and set(table["max_new_tokens"].to_pylist()) == {6}
        assert set(table["eval_set"].to_pylist()) == {"arith"} and set(table["step"].to_pylist()) == {0}
        assert all(len(ids) <= 6 for ids in table["response_token_ids"].to_pylist())
    a, b = (t["response_token_ids"].to_pylist() for t in tables)
    assert a == b  # greedy: the same answers in two runs
    assert a[0::2] == a[1::2]  # ... and for both samples of a prompt, whose seeds differ
    assert len(set(tables[0]["sampling_seed"].to_pylist())) == 6
    assert tables[0]["response_text"].to_pylist() == tables[1]["response_text"].to_pylist()
    assert [ln for ln in runs[0].stdout.splitlines() if ln.startswith("eval arith")] == [
        ln for ln in runs[1].stdout.splitlines() if ln.startswith("eval arith")
    ]
    # The stored rewards are the ones the metrics were computed from.
    metrics = read_metrics(ObjectStore.from_uri(str(tmp_path / "ev1" / "tables")), "ev1").to_pylist()
    m = {r["name"]: r["value"] for r in metrics}
    assert m["eval/arith/reward_mean"] == pytest.approx(sum(tables[0]["reward"].to_pylist()) / 6)
    report = render(tmp_path / "ev1")
    assert "**arith**, step 0 (greedy, at most 6 tokens): 6 samples" in report
