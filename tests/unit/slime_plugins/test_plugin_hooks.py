"""slime's hooks as sluiceway's (issue 41 points 1, 3, 4): which convention a function speaks, slime's `args` names,
a returned Sample as a row and back, slime's reward function and dynamic filter on rows."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from sluiceway.flows.config import RunConfig, field_flags
from sluiceway.flows.slime.flag_table import SLIME_FLAGS, slime_flag_switches
from sluiceway.infra.errors import UserError
from sluiceway.tasks.rollout.slime_plugins import provide_slime_names
from sluiceway.tasks.rollout.slime_plugins.args import attr_name, set_router, slime_args
from sluiceway.tasks.rollout.slime_plugins.convention import (
    FILTER,
    GENERATE,
    GROUP_RM,
    RM,
    SLIME,
    SLUICEWAY,
    convention_of,
    load_plugin,
)
from sluiceway.tasks.rollout.slime_plugins.generate import generation_of_sample
from sluiceway.tasks.rollout.slime_plugins.reward import sample_of_row, slime_filter, slime_scorer

provide_slime_names()
from slime.utils.types import Sample  # noqa: E402


def cfg(**rollout) -> RunConfig:
    return RunConfig(data={"prompt_data": "env:arithmetic"}, reward={"reward_key": "score"}, rollout=rollout)


# -- conventions -----------------------------------------------------------------------------------------------


async def slime_generate(args, sample: Sample, sampling_params): ...
async def slime_generate_eval(a, s, p, evaluation=False): ...
async def our_generate(ctx, prompt, params): ...
async def starred(*args): ...
async def odd_names(a, b, c): ...
async def slime_rm(args, sample, **kwargs): ...
async def our_rm(response, label, sample): ...
def slime_dyn(args, group): ...
def our_dyn(rows): ...
def our_rm_documented(response, label, sample=None): ...  # both counts bind: its names tell (issue 53)
def slime_rm_defaulted(args, sample, extra=None): ...
async def unclear_rm(a, b, c=None): ...


@pytest.mark.parametrize(("fn", "hook", "want"), [
    (slime_generate, GENERATE, SLIME), (slime_generate_eval, GENERATE, SLIME), (our_generate, GENERATE, SLUICEWAY),
    (slime_rm, RM, SLIME), (our_rm, RM, SLUICEWAY), (slime_rm, GROUP_RM, SLIME), (our_rm, GROUP_RM, SLUICEWAY),
    (slime_dyn, FILTER, SLIME), (our_dyn, FILTER, SLUICEWAY),
    (our_rm_documented, RM, SLUICEWAY), (slime_rm_defaulted, RM, SLIME),
])  # fmt: skip
def test_convention_told_from_signature(fn, hook, want):
    assert convention_of(fn, hook) == want


@pytest.mark.parametrize("fn", [starred, odd_names])
def test_ambiguous_is_one_line_naming_both(fn):
    with pytest.raises(UserError) as e:
        convention_of(fn, GENERATE, name="mod.fn")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("mod.fn(")
    assert "(args, sample, sampling_params[, evaluation])" in msg and "(ctx, prompt, params)" in msg
    assert "--plugin-convention" in msg
    assert convention_of(fn, GENERATE, "slime") == SLIME and convention_of(fn, GENERATE, "sluiceway") == SLUICEWAY


def test_a_reward_neither_count_nor_names_tell_still_asks():
    with pytest.raises(UserError, match="set --plugin-convention"):
        convention_of(unclear_rm, RM, name="mod.rm")


def test_dotted_path_loads_as_slime_does(tmp_path, monkeypatch):
    (tmp_path / "myplug_gen.py").write_text(
        "from slime.utils.types import Sample\nasync def generate(args, sample, sampling_params):\n    return sample\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        fn = load_plugin("myplug_gen.generate", "--custom-generate-function-path")
        assert convention_of(fn, GENERATE) == SLIME
    finally:
        sys.modules.pop("myplug_gen", None)
    with pytest.raises(UserError, match="cannot import nosuchmod"):
        load_plugin("nosuchmod.fn", "--custom-rm-path")


# -- args ------------------------------------------------------------------------------------------------------


def test_args_have_slime_names_for_every_flag(tmp_path):
    ns = slime_args(cfg(rollout_max_context_len=1024), tmp_path, slime_flag_switches())  # as runs build it
    for flag in [*SLIME_FLAGS, *field_flags()]:
        assert hasattr(ns, attr_name(flag)), flag
    for name in ("sglang_router_ip", "sglang_router_port", "rollout_max_context_len", "partial_rollout",
                 "hf_checkpoint", "rm_url", "reward_key", "apply_chat_template", "rollout_num_engines",
                 "sglang_server_concurrency", "n_samples_per_prompt", "rollout_temperature", "rollout_top_p",
                 "rollout_top_k", "rollout_max_response_len", "rollout_stop", "rollout_stop_token_ids",
                 "rollout_skip_special_tokens", "rollout_seed", "group_rm", "custom_rm_path", "rm_type"):  # fmt: skip
        assert hasattr(ns, name), name
    assert ns.hf_checkpoint == str(tmp_path.resolve()) and ns.rollout_max_context_len == 1024
    assert ns.reward_key == "score" and ns.rollout_top_k == -1 and ns.rollout_num_engines >= 1
    set_router(ns, "http://127.0.0.1:30001")
    assert (ns.sglang_router_ip, ns.sglang_router_port) == ("127.0.0.1", 30001)


def test_custom_config_yaml_sets_attributes(tmp_path):
    path = tmp_path / "extra.yaml"
    path.write_text("max_turns: 3\nrollout_temperature: 0.5\ntool_names: [a, b]\n")
    ns = slime_args(cfg(custom_config_path=str(path)), tmp_path)
    assert ns.max_turns == 3 and ns.rollout_temperature == 0.5 and ns.tool_names == ["a", "b"]


def test_context_len_bounds_prompt_len():
    with pytest.raises(ValueError, match="rollout_max_context_len"):
        cfg(rollout_max_context_len=100, rollout_max_prompt_len=200)


# -- Sample <-> row ----------------------------------------------------------------------------------------------


def args_ns(tmp_path):
    return slime_args(cfg(), tmp_path)


def retool_like_sample() -> Sample:
    s = Sample(index=3, group_index=1, prompt="Q?", label="4", metadata={"topic": "math"})
    s.tokens = [1, 2, 3]
    s.append_response_tokens(tokens=[10, 11], log_probs=[-0.5, -0.25], trainable=True,
                             meta_info={"finish_reason": {"type": "stop"}, "weight_version": "2"})  # fmt: skip
    s.append_response_tokens(tokens=[20, 21, 22], trainable=False)
    s.append_response_tokens(tokens=[12], log_probs=[-1.0], trainable=True,
                             meta_info={"finish_reason": {"type": "length"}, "weight_version": "3"})  # fmt: skip
    s.response = "the answer"
    s.reward = {"score": 1.0, "acc": True}
    s.tool_call_count = 1  # a plugin's own attribute
    return s


def test_sample_becomes_row_parts(tmp_path):
    g = generation_of_sample(retool_like_sample(), args_ns(tmp_path), 0.5)
    assert g.prompt_ids == [1, 2, 3] and g.token_ids == [10, 11, 20, 21, 22, 12]
    assert g.loss_mask == [1, 1, 0, 0, 0, 1] and g.logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert g.finish_reason == "length" and g.weight_versions == [2, 3] and g.weight_version == 3
    assert g.reward == 1.0 and g.reward_details["slime_reward"] == {"score": 1.0, "acc": True}
    record = g.row_metadata["slime_sample"]
    assert g.row_metadata["topic"] == "math" and record["tool_call_count"] == 1 and record["status"] == "truncated"
    json.dumps(g.row_metadata)


def test_disagreeing_lengths_are_a_failed_sample(tmp_path):
    s = Sample(tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1], status=Sample.Status.COMPLETED)
    g = generation_of_sample(s, args_ns(tmp_path))
    assert g.finish_reason == "failed" and "loss_mask has 1 entries" in g.row_metadata["failure_reason"]
    assert g.loss_mask == [0, 0]
    s = Sample(tokens=[1], response_length=5, status=Sample.Status.COMPLETED)
    assert generation_of_sample(s, args_ns(tmp_path)).finish_reason == "failed"
    s = Sample(tokens=[1, 2], response_length=1, status="completed", reward={"acc": 1})  # tau-bench's string status
    g = generation_of_sample(s, args_ns(tmp_path))
    assert g.finish_reason == "stop" and g.reward == 0.0 and "no key 'score'" in g.reward_details["message"]


def test_remove_sample_masks_the_row(tmp_path):
    s = retool_like_sample()
    s.remove_sample = True
    g = generation_of_sample(s, args_ns(tmp_path))
    assert g.loss_mask == [0] * 6 and g.row_metadata["slime_sample"]["loss_mask"] == [1, 1, 0, 0, 0, 1]


def row_of(g, reward=None, details=None) -> dict:
    return {"group_id": 1, "sample_index": 0, "prompt": "Q?", "label": "4", "prompt_token_ids": g.prompt_ids,
            "response_token_ids": g.token_ids, "response_text": "the answer", "rollout_logprobs": g.logprobs,
            "loss_mask": g.loss_mask, "status": "truncated", "metadata": json.dumps(g.row_metadata),
            "reward": reward, "reward_details": details, "teacher_logprobs": None}  # fmt: skip


def test_row_gives_back_the_sample(tmp_path):
    original = retool_like_sample()
    g = generation_of_sample(original, args_ns(tmp_path))
    s = sample_of_row(row_of(g, 1.0, json.dumps(g.reward_details)))
    assert isinstance(s, Sample) and s.status is Sample.Status.TRUNCATED
    for name in ("tokens", "response_length", "loss_mask", "rollout_log_probs", "response", "label", "index",
                 "group_index", "weight_versions", "reward"):  # fmt: skip
        assert getattr(s, name) == getattr(original, name), name
    assert s.tool_call_count == 1 and s.metadata == {"topic": "math"}


def test_slime_rm_scores_rows(tmp_path):
    args = args_ns(tmp_path)
    g = generation_of_sample(Sample(tokens=[1, 2], response_length=1, status=Sample.Status.COMPLETED), args)

    async def rm(args, sample):
        return {"score": 0.5 + sample.response_length, "acc": False}

    async def group_rm(args, samples):
        return [len(samples)] * len(samples)

    assert asyncio.run(slime_scorer(rm, args, False)("r", "l", row_of(g))) == (
        1.5, {"source": "slime", "slime_reward": {"score": 1.5, "acc": False}})  # fmt: skip
    assert asyncio.run(slime_scorer(group_rm, args, True)([], [], [row_of(g)] * 2)) == [(2.0, {"source": "slime"})] * 2


def test_slime_dynamic_filter(tmp_path):
    from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std

    args = args_ns(tmp_path)
    g = generation_of_sample(Sample(tokens=[1, 2], response_length=1, status=Sample.Status.COMPLETED), args)
    same = [row_of(g, 1.0, {"slime_reward": {"score": 1.0}}) for _ in range(2)]
    spread = [row_of(g, r, {"slime_reward": {"score": r}}) for r in (0.0, 1.0)]
    check = slime_filter(check_reward_nonzero_std, args, "check_reward_nonzero_std")
    assert check(same) == "zero_std_1.0" and check(spread) is None
    assert slime_filter(lambda args, group: False, args, "mine")(spread) == "mine"


def run_generate(tmp_path, fn, args=None):
    """`SlimeGenerate` around `fn` for the planned sample 2 of group 1 (no engine, no tokenizer)."""
    from sluiceway.tasks.rollout.multiturn import GenerateContext
    from sluiceway.tasks.rollout.rollout import PromptItem
    from sluiceway.tasks.rollout.slime_plugins.generate import SlimeGenerate

    (tmp_path / "tokenizer_config.json").write_text("{}")
    args = args or args_ns(tmp_path)

    class State:  # GenerateState without a tokenizer to load
        sampling_params = {"temperature": 1.0}

    import slime.rollout.sglang_rollout as sr

    gen = SlimeGenerate(fn, "mod.fn", args, False)
    ctx = GenerateContext(client=None, tokenizer=None, rid="run/0/1/2", max_new_tokens=8)
    orig, sr.GenerateState = sr.GenerateState, lambda args: State()
    try:
        return asyncio.run(gen(ctx, PromptItem("p0", "Q?", [1], "4", {}), {"sampling_seed": 5}))
    finally:
        sr.GenerateState = orig


def agent_sample(sample, k: int, reward=None) -> Sample:
    s = Sample(index=sample.index, prompt=f"agent {k}", label=sample.label, tokens=[1, 2, 10 + k], response_length=1,
               rollout_log_probs=[-0.5], status=Sample.Status.COMPLETED, reward=reward)  # fmt: skip
    s.rollout_id = sample.index
    return s


def test_fan_out_becomes_sibling_rows(tmp_path):
    """slime's multi_agent: a list of Samples for one, sharing rollout_id: every one a row of the group; the
    slime --custom-rm-path gets the Samples left without a reward as one list (batched_async_rm)."""
    (tmp_path / "rm.py").write_text(
        "async def rm(args, samples):\n    return [{'score': len(samples) + 0.5}] * len(samples)\n"
    )
    args = args_ns(tmp_path)
    args.custom_rm_path = f"{tmp_path / 'rm.py'}:rm"

    async def fan(args, sample, sampling_params):
        return [agent_sample(sample, 0, reward={"score": 1.0}), agent_sample(sample, 1), agent_sample(sample, 2)]

    g = run_generate(tmp_path, fan, args)
    assert [x.token_ids for x in [g, *g.siblings]] == [[10], [11], [12]]
    assert [x.reward for x in [g, *g.siblings]] == [1.0, 2.5, 2.5]
    assert all(x.row_metadata["fanout_of"] == 2 for x in [g, *g.siblings])
    assert g.siblings[0].row_metadata["slime_sample"]["rollout_id"] == g.row_metadata["slime_sample"]["rollout_id"]

    from sluiceway.tasks.rollout.rollout import with_siblings

    plain = generation_of_sample(agent_sample(Sample(index=0), 5), args)
    assert [x.token_ids for x in with_siblings([plain, g])] == [[15], [10], [11], [12]]
    assert with_siblings([plain]) == [plain]


def test_fan_out_needs_one_rollout_id(tmp_path):
    async def unlabelled(args, sample, sampling_params):
        return [agent_sample(sample, 0), Sample(tokens=[1, 2], response_length=1, status=Sample.Status.COMPLETED)]

    with pytest.raises(UserError, match="must share one rollout_id"):
        run_generate(tmp_path, unlabelled)

    async def empty(args, sample, sampling_params):
        return []

    with pytest.raises(UserError, match="empty list"):
        run_generate(tmp_path, empty)

    async def one(args, sample, sampling_params):  # a list of one needs no rollout_id
        return [Sample(tokens=[1, 2], response_length=1, status=Sample.Status.COMPLETED)]

    assert run_generate(tmp_path, one).siblings == []


def test_hook_flags_refused_by_name():
    from sluiceway.flows.slime.treatments import REFUSED

    hooks = ["--rollout-sample-hook-path", "--buffer-filter-path", "--custom-loss-function-path",
             "--data-source-path", "--custom-eval-rollout-log-function-path"]  # fmt: skip
    for flag in hooks:
        assert SLIME_FLAGS[flag].kind == REFUSED, flag
    assert "--rollout-max-context-len" in field_flags() and "--custom-config-path" in field_flags()
