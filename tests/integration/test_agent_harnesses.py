"""Issue 32: any agent harness trains unchanged. One run on tiny-llama, two steps of 3 prompts x 2 samples, whose
twelve sessions run the ten harnesses of examples/agent_harnesses.py in turn (tests/data/agent_harness_mix.py):
the OpenAI Agents SDK with its default Responses model and with OpenAIChatCompletionsModel, the openai client
streaming chat completions and streaming the Responses API, LangChain's ChatOpenAI.bind_tools invoked and
streamed, the anthropic client with tools and streamed, and a separate process configured only through its
environment (OPENAI_* and ANTHROPIC_*). Every session's row is trained, and its token ids are, turn by turn, what
the engine took in and gave out (its own request log), the rest masked out, the log-probs the engine's."""

import json
import math

import numpy as np
import pytest
from cli_run import run_cli
from paths import DATA

from sluiceway.storage.metrics import read_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import is_trainable, read_trajectories

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py

AGENT = f"{DATA / 'agent_harness_mix.py'}:agent"
HARNESSES = {"agents_sdk", "agents_sdk_chat", "openai_stream", "responses_stream", "langchain", "langchain_stream",
             "anthropic_tools", "anthropic_stream", "blackbox_openai", "blackbox_anthropic"}  # fmt: skip


def check_row_against_engine(r, engine_log, step) -> int:
    """The row's tokens turn by turn against the engine's request log; returns the number of model turns."""
    prompt, ids, mask, lps = r["prompt_token_ids"], r["response_token_ids"], r["loss_mask"], r["rollout_logprobs"]
    rid = f"run/{step}/{r['group_id']}/{r['sample_index']}"
    pos, k = 0, 0
    while f"{rid}#{k}" in engine_log:
        rec = engine_log[f"{rid}#{k}"]
        start = len(rec["input_ids"]) - len(prompt)
        assert rec["input_ids"] == prompt + ids[:start], (rid, k)
        if k:  # between turns: the new messages, masked out, with log-prob 0
            assert start > pos and mask[pos:start] == [0] * (start - pos) and set(lps[pos:start]) == {0.0}
        out = rec["output_ids"]
        assert ids[start : start + len(out)] == out and mask[start : start + len(out)] == [1] * len(out)
        np.testing.assert_allclose(lps[start : start + len(out)], rec["output_logprobs"], rtol=0, atol=1e-6)
        pos = start + len(out)
        k += 1
    assert k >= 1 and pos == len(ids), (rid, k, pos, len(ids))
    return k


def test_every_harness_trains_two_steps_with_the_engines_tokens(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    log, harness_log = tmp_path / "engine_requests.jsonl", tmp_path / "harnesses.jsonl"
    run_cli(run_dir, cache, "--num-rollout", "2", "--agent-function-path", AGENT, "--rollout-max-response-len", "128",
            "--rollout-max-prompt-len", "384", "--rollout-batch-size", "3", "--n-samples-per-prompt", "2",
            "--global-batch-size", "6", "--micro-batch-size", "6",
            env={"SLUICEWAY_ENGINE_REQUEST_LOG": str(log), "AGENT_HARNESS_LOG": str(harness_log)})  # fmt: skip
    runs = [json.loads(line) for line in harness_log.read_text().splitlines()]
    assert [r for r in runs if r["error"]] == [] and len(runs) == 12, runs
    assert {r["harness"] for r in runs} == HARNESSES
    engine_log = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        engine_log[rec["rid"]] = rec  # a re-sent rid (router retry) answers the same
    turns = []
    store = ObjectStore.from_uri(str(run_dir / "tables"))
    for step in (0, 1):
        rows = [r for r in read_trajectories(store, "run", step).to_pylist() if is_trainable(r)]
        assert len(rows) == 6, [(r["status"], r["filter_reason"]) for r in rows]
        for r in rows:
            assert json.loads(r["reward_details"]) == {"source": "agent"} and r["reward"] is not None
            assert "add" in r["prompt"]  # the harness's own prompt, with its tool
            turns.append(check_row_against_engine(r, engine_log, step))
    assert sorted(turns) == [1] * turns.count(1) + [2] * (12 - turns.count(1)) and turns.count(2) >= 10, turns
    # The sessions' keys are handed to the agents only: nothing the run wrote holds one.
    for f in run_dir.rglob("*"):
        assert not f.is_file() or b"sk-sluiceway-" not in f.read_bytes(), f
    m = read_metrics(store, "run").to_pylist()
    losses = {r["step"]: r["value"] for r in m if r["name"] == "train/loss"}
    assert set(losses) == {0, 1} and all(math.isfinite(v) for v in losses.values())
