"""Issue 41: plugins written in slime's style run unchanged through the real CLI on tiny-llama.

One run, two steps: a retool-shaped multi-turn generate (dotted path, found on PYTHONPATH as slime's scripts arrange)
posting to the router's /generate with GenerateState's sampling params unchanged (so no 400), model tokens appended
trainable with their log-probs and a tool result untrainable; a reward function returning a dict, --reward-key
score. Every trained row is checked against the engine's request log. A function whose convention its signature
cannot tell is one line, exit 2, before any engine starts.
"""

import json
import math
import os
import subprocess
import textwrap

from cli_run import cli_args, run_cli

from sluiceway.storage.metrics import read_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import is_trainable, read_trajectories

PLUGIN = """
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.types import Sample

TOOL_RESULT = "<result>42</result>"


async def generate(args, sample: Sample, sampling_params) -> Sample:
    assert isinstance(sample, Sample) and sample.status is Sample.Status.PENDING and not sample.tokens
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    sample.tokens = list(state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"])
    sample.loss_mask, sample.response = [], ""
    for turn in range(2):
        params = dict(sampling_params, max_new_tokens=4)
        out = await post(url, {"input_ids": sample.tokens, "sampling_params": params, "return_logprob": True})
        lp = out["meta_info"]["output_token_logprobs"]
        sample.append_response_tokens(args, tokens=[x[1] for x in lp], log_probs=[x[0] for x in lp],
                                      trainable=True, meta_info=out["meta_info"], text=out["text"])
        if turn == 0:
            obs = state.tokenizer(TOOL_RESULT, add_special_tokens=False)["input_ids"]
            sample.append_response_tokens(args, tokens=obs, trainable=False, text=TOOL_RESULT)
    sample.tool_call_count = 1
    return sample


async def reward_func(args, sample, **kwargs):
    score = (sum(sample.tokens[-sample.response_length:]) % 7) / 7
    return {"score": score, "acc": score > 0.5, "calls": getattr(sample, "tool_call_count", 0)}


async def unclear(*parts):
    return parts[1]
"""


def _env(tmp_path, log):
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
            "SLUICEWAY_ENGINE_REQUEST_LOG": str(log)}  # fmt: skip


def test_retool_shaped_plugin_trains_two_steps(tmp_path):
    (tmp_path / "slimeplug_retool.py").write_text(textwrap.dedent(PLUGIN))
    run_dir, cache, log = tmp_path / "run", tmp_path / "cache", tmp_path / "requests.jsonl"
    run_cli(run_dir, cache, "--num-rollout", "2", "--custom-generate-function-path", "slimeplug_retool.generate",
            "--custom-rm-path", "slimeplug_retool.reward_func", "--reward-key", "score",
            "--rollout-max-response-len", "24", "--rollout-top-p", "1.0", env=_env(tmp_path, log))  # fmt: skip
    requests = [json.loads(line) for line in log.read_text().splitlines()]
    store = ObjectStore.from_uri(str(run_dir / "tables"))
    for step in (0, 1):
        rows = [r for r in read_trajectories(store, "run", step).to_pylist() if is_trainable(r)]
        assert len(rows) == 16, [(r["status"], r["filter_reason"]) for r in rows]
        for r in rows:
            prompt = list(r["prompt_token_ids"])
            resp = list(r["response_token_ids"])
            first = _turn(requests, prompt, resp)
            n1 = len(first["output_ids"])
            seconds = [_turn(requests, prompt + resp[:j], resp[j:]) for j in range(n1 + 1, len(resp))]
            (second,) = [x for x in seconds if x is not None]
            n2 = len(second["output_ids"])
            obs = len(resp) - n1 - n2
            assert obs > 0 and resp[n1 + obs :] == second["output_ids"]
            assert r["loss_mask"] == [1] * n1 + [0] * obs + [1] * n2
            want = first["output_logprobs"] + [0.0] * obs + second["output_logprobs"]
            assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(r["rollout_logprobs"], want, strict=True))
            assert r["weight_versions"] and r["weight_version"] == r["weight_versions"][-1]
            details = json.loads(r["reward_details"])
            assert details["slime_reward"]["score"] == r["reward"] and details["slime_reward"]["calls"] == 1
            meta = json.loads(r["metadata"])["slime_sample"]
            assert meta["tool_call_count"] == 1 and meta["response"].count("<result>42</result>") == 1
    losses = {r["step"]: r["value"] for r in read_metrics(store, "run").to_pylist() if r["name"] == "train/loss"}
    assert set(losses) == {0, 1} and all(math.isfinite(v) for v in losses.values())


def _turn(requests, input_ids, rest):
    """The engine's answer to `input_ids` that `rest` starts with (a group's samples share their prompt)."""
    for r in requests:
        if r["input_ids"] == input_ids and r["output_ids"] and rest[: len(r["output_ids"])] == r["output_ids"]:
            return r
    return None


def test_ambiguous_function_is_one_line_before_engines(tmp_path):
    (tmp_path / "slimeplug_retool.py").write_text(textwrap.dedent(PLUGIN))
    env = dict(os.environ, SLUICEWAY_CACHE=str(tmp_path / "cache"), **_env(tmp_path, tmp_path / "r.jsonl"))
    args = cli_args(tmp_path / "run", "--custom-generate-function-path", "slimeplug_retool.unclear")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert "slimeplug_retool.unclear(*parts): cannot tell whether it is slime's" in lines[-1]
    assert "--plugin-convention" in lines[-1]
    assert not (tmp_path / "r.jsonl").exists() and not (tmp_path / "run" / "logs").exists()
