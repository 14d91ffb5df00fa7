"""Issue 41: plugins written in slime's style run unchanged through the real CLI on tiny-llama.

One run, two steps: a retool-shaped multi-turn generate (dotted path, found on PYTHONPATH as slime's scripts arrange)
posting to the router's /generate with GenerateState's sampling params unchanged (so no 400), model tokens appended
trainable with their log-probs and a tool result untrainable; a reward function returning a dict, --reward-key
score. Every trained row is checked against the engine's request log. A function whose convention its signature
cannot tell is one line, exit 2, before any engine starts.

A second run, two steps: a multi_agent-shaped generate (two agents per sample, a list of Samples sharing rollout_id,
every one trained), a search-r1-shaped reward (label a dict, sample.label["ground_truth"]) getting the Samples left
without a reward as one list, slime's dynamic filter, a rollout sample filter marking one Sample removed, an
all-samples process and a rollout log function writing what they got to a file, and a reward post-process
whose rewards (each role's rewards centred) are stored beside the raw ones and trained on.
"""

import json
import math
import os
import subprocess
import textwrap

import pytest
from cli_run import cli_args, run_cli

from sluiceway.storage.metrics import read_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import is_trainable, read_trajectories

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py

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


MULTI = """
import copy
import json
import os

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.types import Sample

ROLES = ("solver", "critic")


async def generate_with_multi_agents(args, sample: Sample, sampling_params, evaluation=False) -> list[Sample]:
    assert isinstance(sample.label, dict) and not evaluation
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    out = []
    for role in ROLES:
        s = copy.deepcopy(sample)
        s.prompt = f"{sample.prompt} [{role}]"
        s.tokens = list(state.tokenizer(s.prompt, add_special_tokens=False)["input_ids"])
        params = dict(sampling_params, max_new_tokens=4)
        reply = await post(url, {"input_ids": s.tokens, "sampling_params": params, "return_logprob": True})
        lp = reply["meta_info"]["output_token_logprobs"]
        s.append_response_tokens(args, tokens=[x[1] for x in lp], log_probs=[x[0] for x in lp], trainable=True,
                                 meta_info=reply["meta_info"], text=reply["text"])
        s.agent_role = role
        s.rollout_id = sample.index
        if role == "solver":
            s.reward = float(len(s.response) % 3) / 2
        out.append(s)
    return out


async def reward_func(args, sample, **kwargs):
    if isinstance(sample, list):  # slime's batched_async_rm: a fan-out's Samples left without a reward
        return [await reward_func(args, s) for s in sample]
    assert sample.agent_role == "critic"
    target = str(sample.label["ground_truth"]["target"])
    return 0.2 + (target in sample.response) + (sum(sample.tokens[-sample.response_length:]) % 5) / 5


def odd_groups(args, group):
    n = args.n_samples_per_prompt
    assert len(group) == 2 * n and len({s.rollout_id for s in group}) == n
    keep = group[0].group_index % 3 != 1
    return DynamicFilterOutput(keep=keep, reason=None if keep else "third_group")


def remove_one(args, data):
    assert all(len(group) == 2 * args.n_samples_per_prompt for group in data)
    data[0][1].remove_sample = True


def process_all(args, all_samples, data_source):
    try:
        data_source.get_samples(1)
        raised = None
    except NotImplementedError as e:
        raised = str(e)
    removed = sum(s.remove_sample for g in all_samples for s in g)
    _log("all", groups=[g[0].group_index for g in all_samples], removed=removed, raised=raised)


def log_rollout(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    _log("log", rollout_id=rollout_id, samples=len(samples), removed=[s.index for s in samples if s.remove_sample],
         metrics=sorted(rollout_extra_metrics), time=rollout_time)
    return True


def post_process(args, samples):
    # per agent role, rewards centred on the role's mean: slime's (raw_rewards, rewards)
    raw = [s.get_reward_value(args) for s in samples]
    by_role = {}
    for s, r in zip(samples, raw):
        by_role.setdefault(s.agent_role, []).append(r)
    means = {role: sum(v) / len(v) for role, v in by_role.items()}
    return raw, [r - means[s.agent_role] for s, r in zip(samples, raw)]


def _log(kind, **what):
    with open(os.environ["SLIMEPLUG_LOG"], "a") as f:
        f.write(json.dumps({"kind": kind, **what}) + "\\n")
"""


def test_multi_agent_shaped_plugin_trains_two_steps(tmp_path):
    from cli_run import BATCH, N

    (tmp_path / "slimeplug_multi.py").write_text(textwrap.dedent(MULTI))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "reward_model":
                                        {"ground_truth": {"target": 2 * i}, "style": "rule"}}) + "\n"
                            for i in range(12)))  # fmt: skip
    run_dir, cache, log, hooks = tmp_path / "run", tmp_path / "cache", tmp_path / "requests.jsonl", tmp_path / "h"
    m = "slimeplug_multi."
    run_cli(run_dir, cache, "--num-rollout", "2", "--prompt-data", str(data), "--input-key", "prompt",
            "--label-key", "reward_model", "--custom-generate-function-path", m + "generate_with_multi_agents",
            "--custom-rm-path", m + "reward_func", "--dynamic-sampling-filter-path", m + "odd_groups",
            "--over-sampling-batch-size", str(BATCH + 2), "--rollout-sample-filter-path", m + "remove_one",
            "--rollout-all-samples-process-path", m + "process_all",
            "--custom-rollout-log-function-path", m + "log_rollout", "--rollout-top-p", "1.0",
            "--custom-reward-post-process-path", m + "post_process",
            env=_env(tmp_path, log) | {"SLIMEPLUG_LOG": str(hooks)})  # fmt: skip
    requests = [json.loads(line) for line in log.read_text().splitlines()]
    logged = [json.loads(line) for line in hooks.read_text().splitlines()]
    store = ObjectStore.from_uri(str(run_dir / "tables"))
    dropped = 0
    for step in (0, 1):
        stored = read_trajectories(store, "run", step).to_pylist()
        groups: dict[int, list] = {}
        for r in stored:
            groups.setdefault(r["group_id"], []).append(r)
        for members in groups.values():  # every group: 2 x N rows, each planned sample with its sibling
            assert sorted(r["sample_index"] for r in members) == list(range(2 * N))
            meta = [json.loads(r["metadata"]) for r in members]
            assert sorted(x["fanout_of"] for x in meta) == sorted(list(range(N)) * 2)
            assert len({x["slime_sample"]["rollout_id"] for x in meta}) == N
            if members[0]["status"] == "aborted":
                continue
            reasons = {r["filter_reason"] for r in members}
            third = meta[0]["slime_sample"]["group_index"] % 3 == 1
            assert reasons == {"third_group"} if third else len(reasons) == 1 and reasons <= {None, "surplus"}
            dropped += third
        rows = [r for r in stored if is_trainable(r)]
        assert len(rows) == BATCH * 2 * N, [(r["status"], r["filter_reason"]) for r in stored]
        removed = [r for r in rows if json.loads(r["metadata"])["slime_sample"].get("remove_sample")]
        assert len(removed) == 1 and removed[0]["loss_mask"] == [0] * len(removed[0]["response_token_ids"])
        for r in rows:
            meta = json.loads(r["metadata"])
            record = meta["slime_sample"]
            assert r["prompt"].endswith(f"[{record['agent_role']}]")
            made = [q for q in requests if q["input_ids"] == list(r["prompt_token_ids"])
                    and q["output_ids"] == list(r["response_token_ids"])]  # fmt: skip
            assert made, "no engine request made this row"
            want = made[0]["output_logprobs"]
            assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(r["rollout_logprobs"], want, strict=True))
            if r is not removed[0]:
                assert r["loss_mask"] == [1] * len(r["response_token_ids"])
            details = json.loads(r["reward_details"])
            assert details["source"] == "slime"
            if record["agent_role"] == "critic":
                target = str(record["label"]["ground_truth"]["target"])
                text = record["response"]
                tokens = r["response_token_ids"]
                want = 0.2 + (target in text) + (sum(tokens) % 5) / 5
                assert math.isclose(r["reward"], want), (r["reward"], want)
            else:
                assert r["reward"] == float(len(record["response"]) % 3) / 2
        # The reward post-process saw every trained row (the removed one too); its rewards centre each role.
        post = [json.loads(r["metadata"])["reward_post_process"] for r in rows]
        assert [p["raw"] for p in post] == [r["reward"] for r in rows]
        for role in ("solver", "critic"):
            mine = [p["reward"] for p, r in zip(post, rows) if r["prompt"].endswith(f"[{role}]")]
            assert len(mine) == BATCH * N and abs(sum(mine)) < 1e-9
        (log_line,) = [x for x in logged if x["kind"] == "log" and x["rollout_id"] == step]
        assert log_line["samples"] == len(rows) and len(log_line["removed"]) == 1 and log_line["time"] > 0
        assert "filter/groups_kept" in log_line["metrics"]
        all_line = [x for x in logged if x["kind"] == "all"][step]  # every finished group, the filtered ones too
        assert len(all_line["groups"]) >= BATCH
        assert all_line["removed"] == 1 and "not supported in sluiceway" in all_line["raised"]
    assert dropped > 0  # the dynamic filter dropped groups, over-sampling made up for them
    losses = {r["step"]: r["value"] for r in read_metrics(store, "run").to_pylist() if r["name"] == "train/loss"}
    assert set(losses) == {0, 1} and all(math.isfinite(v) for v in losses.values())
