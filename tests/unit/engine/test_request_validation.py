"""The embedded engine's checks of what a request may carry: the HTTP body (server.parse_json_body), each
sampling field's type and range (server.parse_sampling_params, SamplingParams.validate), and, in the scheduler,
a request whose settings fail there failing alone. Fuzzing the served API: tests/integration/test_engine_fuzz.py."""

from __future__ import annotations

import pytest

from sluiceway.models.engine import Engine, EngineError, GenerateRequest, SamplingParams
from sluiceway.models.engine.requests import BadRequest, parse_json_body, parse_sampling_params

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

JSON = "application/json"


@pytest.mark.parametrize(
    ("raw", "content_type", "status", "says"),
    [
        (b"", JSON, 400, "empty request body"),
        (b"  \n", None, 400, "empty request body"),
        (b"[1, 2]", JSON, 400, "must be a JSON object"),
        (b'{"text": "a"', JSON, 400, "malformed JSON"),
        (b'{"text": "a"}x', JSON, 400, "malformed JSON"),
        (b'{"n": ' + b"1" * 5000 + b"}", JSON, 400, "malformed JSON"),  # past Python's int-string limit
        (b"[" * 100_000, JSON, 400, "nested deeper than 32"),  # json.loads: RecursionError
        (b'{"a": ' + b"[" * 40 + b"]" * 40 + b"}", JSON, 400, "nested deeper than 32"),
        (b'{"text": "\xff"}', JSON, 400, "not valid UTF-8"),
        (b'{"text": "\xed\xa0\x80"}', JSON, 400, "not valid UTF-8"),  # a surrogate, UTF-8 encoded
        ('{"text": "ab"}'.encode("utf-16"), JSON, 400, "not valid UTF-8"),
        (b'{"text": "a\\ud800b"}', JSON, 400, "lone UTF-16 surrogate"),
        (b'{"rid": ["ok", "\\udfff"]}', JSON, 400, "lone UTF-16 surrogate"),
        (b'{"\\ud83d": 1}', JSON, 400, "lone UTF-16 surrogate"),  # in a key
        (b'{"text": "a"}', "text/plain", 415, "application/json"),
        (b"text=a", "application/x-www-form-urlencoded", 415, "application/json"),
    ],
)
def test_malformed_bodies_are_refused_with_a_reason(raw, content_type, status, says):
    with pytest.raises(BadRequest, match=says) as e:
        parse_json_body(raw, content_type)
    assert e.value.status == status


def test_well_formed_bodies_parse():
    assert parse_json_body(b"", JSON, required=False) == {}
    assert parse_json_body(b'{"text": "\\ud83d\\ude00"}', JSON) == {"text": "\U0001f600"}  # a surrogate pair
    assert parse_json_body(b'{"a": 1}', "application/json; charset=utf-8") == {"a": 1}
    assert parse_json_body(b'{"a": 1}', "application/vnd.api+json") == {"a": 1}
    assert parse_json_body(b'{"a": 1}', None) == {"a": 1}  # no Content-Type: taken as JSON
    deep = b'{"a": ' + b"[" * 31 + b"]" * 31 + b"}"  # 32 levels with the object itself
    assert parse_json_body(deep, JSON)


def _checked(fields: dict, vocab_size: int = 100) -> SamplingParams:
    """What the server does with a request's sampling_params: types first, then the engine's ranges."""
    sp = parse_sampling_params(fields)
    try:
        sp.validate(vocab_size)
    except EngineError as e:
        raise BadRequest(str(e)) from None
    return sp


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"top_k": 10**30}, r"top_k must be -1 \(disabled\) or in \[1, 2\*\*31-1\]"),
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k must be int"),
        ({"top_k": True}, "top_k must be int"),
        ({"max_new_tokens": 0}, r"max_new_tokens must be an integer in \[1, 2\*\*31-1\]"),
        ({"max_new_tokens": 2**31}, "max_new_tokens"),
        ({"max_new_tokens": 10**30}, "max_new_tokens"),
        ({"max_new_tokens": "8"}, "max_new_tokens must be int"),
        ({"sampling_seed": -1}, r"sampling_seed must be in \[0, 2\*\*63-1\]"),
        ({"sampling_seed": 2**63}, "sampling_seed"),
        ({"temperature": 10**400}, "temperature must be a finite number"),  # no float holds it
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": -1e-9}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": 10**400}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": float("-inf")}, "min_p"),
        ({"stop_token_ids": [100]}, "stop_token_ids"),
        ({"stop_token_ids": [-(10**30)]}, "stop_token_ids"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids"),
        ({"n": 10**30}, "n=.* not supported"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"made_up": 1}, "unknown field 'made_up'"),
    ],
)
def test_sampling_fields_out_of_range_are_named(fields, says):
    with pytest.raises(BadRequest, match=says):
        _checked(fields)


def test_sampling_field_bounds_are_inclusive():
    sp = _checked({"top_k": 2**31 - 1, "sampling_seed": 2**63 - 1, "max_new_tokens": 2**31 - 1, "temperature": 10**300})
    assert (sp.top_k, sp.sampling_seed, sp.max_new_tokens, sp.temperature) == (2**31 - 1, 2**63 - 1, 2**31 - 1, 1e300)
    assert _checked({"top_k": -1, "sampling_seed": 0, "max_new_tokens": 1, "min_new_tokens": 0, "n": 1}).top_k == -1


def test_a_request_failing_in_the_scheduler_fails_alone(tiny):
    """Settings that break only inside the scheduler (here: changed after submit's validation) abort that one
    request; the others in its batch finish as they would alone. A huge top_k is clamped to the vocabulary."""
    path, _ = tiny
    engine = Engine(path, max_running_requests=4, max_total_len=512)
    try:

        def req(**kw) -> GenerateRequest:
            sp = SamplingParams(max_new_tokens=60, sampling_seed=3, ignore_eos=True, **kw)
            return GenerateRequest([5, 6, 7], sp)

        alone = engine.generate([req()])[0]
        engine.pause()  # all three are admitted, prefilled and sampled together on resume
        good, bad, huge_k = req(), req(), req()
        handles = [engine.submit(r) for r in (good, bad, huge_k)]
        bad.sampling.temperature = 10**400  # no float holds it: the scheduler's conversion raises
        huge_k.sampling.top_k = 10**30  # would overflow the batch's int64 top_k tensor unclamped
        engine.resume()
        out_good, out_bad, out_huge_k = (h.result(timeout=120) for h in handles)
        assert out_bad.finish_reason["type"] == "abort" and "OverflowError" in out_bad.finish_reason["message"]
        for out in (out_good, out_huge_k):
            assert out.finish_reason == {"type": "length", "length": 60}
            assert out.output_ids == alone.output_ids
            assert out.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)
        assert engine.generate([req()])[0].output_ids == alone.output_ids  # and the engine goes on serving
    finally:
        engine.shutdown()
