"""Agents written against the OpenAI client train through the run's token-recording endpoint (docs/agents.md).

- examples/agent_openai_tools.py (the `openai` package, a calculator tool, three turns) trains for two steps on
  tiny-llama: each stored row's token ids are, turn by turn, what the engine took in and gave out (its own
  request log, $SLUICEWAY_ENGINE_REQUEST_LOG), the tool's and the user's tokens are masked out, the log-probs are
  the engine's, and the agent's reward is the row's.
- A session the agent abandons (it hangs up during a model call and posts no reward) is stored as aborted and
  never trained on, through a real router and engine.
"""

import asyncio
import json
import math
import os

import numpy as np
import pytest
from cli_run import run_cli
from paths import ROOT

from sluiceway.infra.engine_group import EngineGroup
from sluiceway.infra.router import SGLangRouter
from sluiceway.models.zoo import load_tokenizer, resolve_checkpoint
from sluiceway.storage.metrics import read_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import ABORTED, is_trainable, read_trajectories
from sluiceway.tasks.rollout.agent.proxy import AgentGenerate, load_agent_function
from sluiceway.tasks.rollout.client import EngineClient
from sluiceway.tasks.rollout.dispatch import PoolDispatcher
from sluiceway.tasks.rollout.pool_target import own_engines
from sluiceway.tasks.rollout.rollout import PromptItem, RolloutSettings, plan_step, run_rollout
from sluiceway.tasks.train.batch import trainable_rows

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py

AGENT = f"{ROOT / 'examples' / 'agent_openai_tools.py'}:agent"


def test_openai_tool_agent_trains_two_steps_with_the_engines_tokens(tmp_path):
    run_dir, cache, log = tmp_path / "run", tmp_path / "cache", tmp_path / "engine_requests.jsonl"
    run_cli(run_dir, cache, "--num-rollout", "2", "--agent-function-path", AGENT, "--rollout-max-response-len", "128",
            "--rollout-max-prompt-len", "320",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
            "--micro-batch-size", "4", env={"SLUICEWAY_ENGINE_REQUEST_LOG": str(log)})  # fmt: skip
    tok = load_tokenizer(resolve_checkpoint("tiny-llama", cache_dir=cache))
    store = ObjectStore.from_uri(str(run_dir / "tables"))
    engine_log = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        engine_log[rec["rid"]] = rec  # a re-sent rid (router retry) answers the same
    tool_ids = tok.encode("<|im_start|>tool\n", add_special_tokens=False)
    user_ids = tok.encode("<|im_start|>user\nSo, the final answer?", add_special_tokens=False)
    for step in (0, 1):
        rows = [r for r in read_trajectories(store, "run", step).to_pylist() if is_trainable(r)]
        assert len(rows) == 4, [(r["status"], r["filter_reason"]) for r in rows]
        for r in rows:
            prompt, ids, mask, lps = (
                r["prompt_token_ids"],
                r["response_token_ids"],
                r["loss_mask"],
                r["rollout_logprobs"],
            )
            assert "<tools>" in r["prompt"] and "calculator" in r["prompt"]  # the agent's own prompt, with its tool
            assert json.loads(r["reward_details"]) == {"source": "agent"} and r["reward"] is not None
            rid = f"run/{step}/{r['group_id']}/{r['sample_index']}"
            pos = 0
            for k in range(3):  # three model turns, each the engine's request verbatim
                rec = engine_log[f"{rid}#{k}"]
                start = len(rec["input_ids"]) - len(prompt)
                assert rec["input_ids"] == prompt + ids[:start]
                if k:  # between turns: the new messages, masked out, with log-prob 0
                    assert start > pos and mask[pos:start] == [0] * (start - pos) and set(lps[pos:start]) == {0.0}
                env = ids[pos:start]
                if k == 1:
                    assert _contains(env, tool_ids), tok.decode(env)
                if k == 2:
                    assert _contains(env, user_ids), tok.decode(env)
                out = rec["output_ids"]
                assert ids[start : start + len(out)] == out and mask[start : start + len(out)] == [1] * len(out)
                np.testing.assert_allclose(lps[start : start + len(out)], rec["output_logprobs"], rtol=0, atol=1e-6)
                pos = start + len(out)
            assert pos == len(ids) and f"{rid}#3" not in engine_log
    # The run's API key is handed to the agent only: nothing the run wrote holds it.
    for f in run_dir.rglob("*"):
        assert not f.is_file() or b"sk-sluiceway-" not in f.read_bytes(), f
    m = read_metrics(store, "run").to_pylist()
    losses = {r["step"]: r["value"] for r in m if r["name"] == "train/loss"}
    assert set(losses) == {0, 1} and all(math.isfinite(v) for v in losses.values())


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


ABANDON = """
import json, socket, time
import openai

def agent(base_url, api_key, prompt):
    if prompt["prompt_id"] != "quitter":
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt["prompt"]}])
        return 1.0
    # Hang up during the model call (no answer read), post no reward.
    host, port = base_url.split("//")[1].split("/")[0].split(":")
    path = "/" + base_url.split("//")[1].split("/", 1)[1] + "/chat/completions"
    body = json.dumps({"model": "policy", "max_tokens": 64,
                       "messages": [{"role": "user", "content": prompt["prompt"]}]}).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST {path} HTTP/1.1\\r\\nHost: x\\r\\nAuthorization: Bearer {api_key}\\r\\n"
              f"Content-Type: application/json\\r\\nContent-Length: {len(body)}\\r\\n\\r\\n".encode() + body)
    s.close()
    time.sleep(3)
"""


def test_an_abandoned_session_is_stored_aborted_and_never_trained(tmp_path):
    model_dir = resolve_checkpoint("tiny-llama", cache_dir=tmp_path / "cache")
    tok = load_tokenizer(model_dir)
    store = ObjectStore.from_uri(str(tmp_path / "tables"))
    (tmp_path / "abandon.py").write_text(ABANDON)
    agent = AgentGenerate(load_agent_function(f"{tmp_path / 'abandon.py'}:agent"))
    prompts = [PromptItem(pid, "What is 1 + 1?", tok.encode("What is 1 + 1?"), "2", {}, "What is 1 + 1?")
               for pid in ("quitter", "finisher")]  # fmt: skip
    s = RolloutSettings(n_samples=2, max_new_tokens=64, temperature=1.0, top_p=1.0, stop_token_ids=[], seed=3,
                        groups_needed=2, groups_submitted=2, custom_generate=agent, tokenizer=tok)  # fmt: skip
    env = dict(os.environ, SLUICEWAY_CACHE=str(tmp_path / "cache"))
    with (
        SGLangRouter(tmp_path / "logs") as router,
        EngineGroup(str(model_dir), 1, tmp_path / "logs", router=router, env=env) as pool,
    ):

        async def go():
            async with EngineClient(router.url, pool.urls) as client:
                return await run_rollout(dispatcher=PoolDispatcher([own_engines(client, s.max_concurrency)]),
                                         store=store, run_id="ag", step=0,
                                         work=plan_step(store, "ag", 0, prompts, s, []), settings=s,
                                         decode=tok.decode)  # fmt: skip

        res = asyncio.run(go())
    rows = read_trajectories(store, "ag", 0).to_pylist()
    quit_rows = [r for r in rows if r["prompt_id"] == "quitter"]
    done_rows = [r for r in rows if r["prompt_id"] == "finisher"]
    assert len(quit_rows) == 2 and all(r["status"] == ABORTED and r["reward"] is None for r in quit_rows)
    assert all("dropped its connection" in json.loads(r["metadata"])["abort_reason"] for r in quit_rows)
    assert all(r["status"] == "truncated" and r["reward"] == 1.0 for r in done_rows), done_rows  # no stop ids
    assert res.groups_completed == 1 and res.groups_aborted == 1
    # What the trainer reads of the step: the finished group only.
    trained = trainable_rows(read_trajectories(store, "ag", 0))
    assert {r["prompt_id"] for r in trained} == {"finisher"}


def test_a_step_whose_every_session_aborts_stops_the_run(tmp_path):
    """An agent whose first prompt (its tools block included) is longer than --rollout-max-prompt-len aborts every
    session: the run stops at step 0 with one line naming the reason, instead of 'training' on nothing to the end."""
    import subprocess

    from cli_run import cli_args

    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    args = cli_args(run_dir, "--num-rollout", "2", "--agent-function-path", AGENT, "--rollout-max-prompt-len", "64",
                    "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
                    "--micro-batch-size", "4")  # fmt: skip
    env = dict(os.environ, SLUICEWAY_CACHE=str(cache))
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "none of the 2 groups of step 0 has a sample to train" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not read_metrics(ObjectStore.from_uri(str(run_dir / "tables")), "run").num_rows  # nothing trained
