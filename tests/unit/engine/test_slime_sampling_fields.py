"""The embedded engine's /generate takes what slime's rollout sends and returns the meta_info slime reads (issue 41
point 5). The bodies are built as slime 624b824a builds them: `GenerateState.sampling_params`
(slime/rollout/sglang_rollout.py) and the default `generate`'s payload; `_read_like_slime` reads the answer as
`generate` + `Sample.append_response_tokens` / `_apply_meta_info` (slime/utils/types.py) do."""

from __future__ import annotations

from argparse import Namespace
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from sluiceway.models.engine import Engine, GenerateRequest, SamplingParams
from sluiceway.models.engine.requests import BadRequest, parse_sampling_params
from sluiceway.models.engine.server import build_app

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

MAX_NEW = 6


def slime_sampling_params(args: Namespace) -> dict:
    """GenerateState.__init__'s dict, key for key."""
    params = dict(
        temperature=args.rollout_temperature,
        top_p=args.rollout_top_p,
        top_k=args.rollout_top_k,
        max_new_tokens=args.rollout_max_response_len,
        stop=args.rollout_stop,
        stop_token_ids=args.rollout_stop_token_ids,
        skip_special_tokens=args.rollout_skip_special_tokens,
        no_stop_trim=True,
        spaces_between_special_tokens=False,
    )
    if args.rollout_top_p != 1.0:
        params["custom_params"] = {"return_top_p_token_ids": True}
    return params


# slime's argument defaults but top_p (below 1, so custom_params is sent) and a short response length.
ARGS = Namespace(
    rollout_temperature=1.0,
    rollout_top_p=0.9,
    rollout_top_k=-1,
    rollout_max_response_len=MAX_NEW,
    rollout_stop=None,
    rollout_stop_token_ids=None,
    rollout_skip_special_tokens=False,
)


def slime_generate_payload(prompt_ids: list[int], response_length: int = 0, seed: int | None = None) -> dict:
    """The default generate's body for a text-only sample (and generate_and_rm_group's seed in deterministic mode)."""
    sampling_params = slime_sampling_params(ARGS).copy()
    if seed is not None:
        sampling_params["sampling_seed"] = seed
    sampling_params["max_new_tokens"] -= response_length
    return {"sampling_params": sampling_params, "return_logprob": True, "input_ids": prompt_ids}


def _read_like_slime(output: dict) -> dict:
    """What slime takes from an answer: tokens and log-probs from output_token_logprobs, the status from
    finish_reason["type"], weight_version, and the prefix-cache counters."""
    meta = output["meta_info"]
    tokens = [item[1] for item in meta["output_token_logprobs"]]
    log_probs = [item[0] for item in meta["output_token_logprobs"]]
    status = {"length": "TRUNCATED", "abort": "ABORTED", "stop": "COMPLETED"}[meta["finish_reason"]["type"]]
    return {
        "tokens": tokens,
        "log_probs": log_probs,
        "status": status,
        "weight_version": meta["weight_version"],
        "cached_tokens": meta.get("cached_tokens", 0),
        "prompt_tokens": meta.get("prompt_tokens", 0),
        "text": output["text"],
    }


@pytest.fixture(scope="module")
def served(tiny):
    path, tokenizer = tiny
    engine = Engine(path, max_running_requests=4, max_total_len=128, weight_version="7", seed=0)
    try:
        yield TestClient(build_app(engine)), engine, tokenizer
    finally:
        engine.shutdown()


def test_slime_generate_state_sampling_params_parse():
    sp = parse_sampling_params(slime_sampling_params(ARGS))
    assert sp.spaces_between_special_tokens is False and sp.no_stop_trim is True
    assert sp.skip_special_tokens is False and sp.top_p == 0.9 and sp.max_new_tokens == MAX_NEW
    assert sp.stop == [] and sp.stop_token_ids == []  # slime's None: SGLang's defaults
    # Eval's extras at slime's defaults (repetition_penalty and min_new_tokens are only sent when set).
    assert parse_sampling_params({"custom_params": None, "min_new_tokens": 0, "repetition_penalty": 1.0})


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"spaces_between_special_tokens": "false"}, "sampling_params.spaces_between_special_tokens must be bool"),
        ({"spaces_between_special_tokens": 0}, "sampling_params.spaces_between_special_tokens must be bool"),
        ({"custom_params": [1]}, "sampling_params.custom_params must be dict"),
        ({"custom_params": "return_top_p_token_ids"}, "sampling_params.custom_params must be dict"),
        ({"no_stop_trim": 1}, "sampling_params.no_stop_trim must be bool"),
        ({"skip_special_tokens": "yes"}, "sampling_params.skip_special_tokens must be bool"),
    ],
)
def test_wrong_types_name_the_field(fields, says):
    with pytest.raises(BadRequest, match=says):
        parse_sampling_params(fields)


def test_slime_default_generate_gets_the_meta_info_it_reads(served):
    http, engine, tokenizer = served
    prompt_ids = tokenizer.encode("What is 2 + 3?", add_special_tokens=False)  # _prepare_prompt_ids
    r = http.post("/generate", json=slime_generate_payload(prompt_ids, seed=3))
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    for key in ("output_token_logprobs", "finish_reason", "weight_version", "completion_tokens", "prompt_tokens"):
        assert key in meta, key
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == len(out["output_ids"])
    assert all(len(t) == 3 and t[2] is None and isinstance(t[0], float) for t in meta["output_token_logprobs"])
    assert meta["prompt_tokens"] == len(prompt_ids) and meta["weight_version"] == "7"
    got = _read_like_slime(out)
    assert got["tokens"] == out["output_ids"] and all(lp <= 0.0 for lp in got["log_probs"])
    # This seed runs to max_new_tokens (the same every time: seeded engine, sampling_seed): SGLang's length dict.
    assert meta["finish_reason"] == {"type": "length", "length": MAX_NEW} and got["status"] == "TRUNCATED"
    # spaces_between_special_tokens=False, skip_special_tokens=False: the fast tokenizer's plain decode.
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=False)
    assert 0 <= got["cached_tokens"] <= got["prompt_tokens"]

    # A partial-rollout continuation: sample.tokens (prompt + earlier response) as input_ids, a smaller budget.
    again = http.post("/generate", json=slime_generate_payload(prompt_ids + got["tokens"][:2], response_length=2))
    assert again.status_code == 200, again.text
    assert again.json()["meta_info"]["completion_tokens"] <= MAX_NEW - 2


def test_a_stop_token_is_kept_in_the_text_with_no_stop_trim(served):
    http, _, tokenizer = served
    # Stop on whatever the model emits first: finish_reason stop with the matched id, and no_stop_trim (always
    # sent by slime) keeps that token in the text, as SGLang.
    first = http.post("/generate", json=slime_generate_payload([5, 6, 7], seed=1)).json()["output_ids"][0]
    payload = slime_generate_payload([5, 6, 7], seed=1)
    payload["sampling_params"]["stop_token_ids"] = [first]
    out = http.post("/generate", json=payload).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    assert _read_like_slime(out)["status"] == "COMPLETED" and out["output_ids"] == [first]
    assert out["text"] == tokenizer.decode([first], skip_special_tokens=False)


def test_a_text_prompt_as_slime_search_r1_sends_it(served):
    http, _, tokenizer = served
    sampling_params = slime_sampling_params(ARGS) | {"stop": ["</search>", "</answer>"]}
    out = http.post("/generate", json={"text": "Question: who?", "sampling_params": sampling_params,
                                       "return_logprob": True})  # fmt: skip
    assert out.status_code == 200, out.text
    meta = out.json()["meta_info"]
    assert meta["prompt_tokens"] == len(tokenizer("Question: who?")["input_ids"])
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] >= 1
    assert meta["finish_reason"]["type"] in ("length", "stop")


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"custom_logit_processor": "serialized"}, "custom_logit_processor is not supported"),
        ({"return_routed_experts": True}, "return_routed_experts=True is not supported"),
    ],
)
def test_what_this_engine_cannot_do_is_a_400_naming_the_field(served, extra, says):
    http, _, _ = served
    r = http.post("/generate", json=slime_generate_payload([5, 6, 7]) | extra)
    assert r.status_code == 400 and says in r.json()["message"], r.text
    ok = http.post("/generate", json=slime_generate_payload([5, 6, 7]) | {"return_routed_experts": False})
    assert ok.status_code == 200  # slime's default (no routing replay), and the router's defaults pass


def test_cached_tokens_counts_a_prompt_whose_prefill_was_shared(served):
    _, engine, _ = served
    prompt = [9, 8, 7, 6, 5]
    engine.pause()  # both queued before either is admitted: the second copies the first's prompt KV
    try:
        handles = [engine.submit(GenerateRequest(list(prompt), SamplingParams(max_new_tokens=2))) for _ in range(2)]
    finally:
        engine.resume()
    outs = [h.result(timeout=60) for h in handles]
    assert sorted(o.cached_tokens for o in outs) == [0, len(prompt)]


def test_spaces_between_special_tokens_reaches_the_tokenizer():
    """Passed to decode as SGLang's detokenizer does; only when off, so the default never hands a tokenizer an
    argument it may not take. (Ours are fast tokenizers, which ignore it: see SamplingParams.)"""
    seen: list[dict] = []
    fake = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids, **kw: seen.append(kw) or ""))
    Engine.decode(fake, [1], SamplingParams(spaces_between_special_tokens=False, skip_special_tokens=False))
    Engine.decode(fake, [1], SamplingParams())
    assert seen == [{"skip_special_tokens": False, "spaces_between_special_tokens": False},
                    {"skip_special_tokens": True}]  # fmt: skip
