"""Fuzzing the embedded engine's HTTP API on loopback: one request must not hurt others.

A seeded generator makes malformed requests (wrong types, out-of-range and huge numbers, NaN and infinities,
unknown fields, bad Unicode, deep nesting, truncated JSON, wrong content types, empty bodies). Each must get a
4xx in SGLang's error shape, with /health OK after it, while a well-formed sampled generation runs alongside;
that generation is restarted whenever it finishes, and every run must equal the same request run alone.
"""

from __future__ import annotations

import json
import random
import threading

import httpx
import pytest

from sluiceway.infra.engine_group import EngineGroup

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

MAX_TOTAL_LEN = 2048
LONG = {
    "input_ids": [5, 6, 7],
    "sampling_params": {"max_new_tokens": 2000, "temperature": 1.0, "top_k": 50, "top_p": 0.9,
                        "sampling_seed": 20, "ignore_eos": True},
}  # fmt: skip
SMALL = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}  # well-formed, to be broken
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

NAN, INF = float("nan"), float("inf")
# Per sampling field: values that are out of range, or not a number that float() can hold.
BAD_NUMBERS = {
    "max_new_tokens": [-1, 2**31, 10**30, -(10**30), 2**63],  # 0 is SGLang's scoring call (input log-probs)
    "top_k": [0, -2, 2**31, 10**30, -(10**30), 2**64],
    "sampling_seed": [-1, 2**63, 10**30, -(10**30)],
    "min_new_tokens": [-1, 7, 10**30],
    "n": [0, 2, -1, 10**30],
    "temperature": [-1, -1e-9, NAN, INF, -INF, 10**400],
    "top_p": [0, -0.5, 1.5, NAN, INF, 10**400],
    "min_p": [-0.1, 1.1, NAN, -INF, 10**400],
    "frequency_penalty": [0.5, NAN, 10**30],
    "presence_penalty": [-2.0, INF],
    "repetition_penalty": [0, 1.5, NAN],
}
INT_FIELDS = ["max_new_tokens", "top_k", "sampling_seed"]
FLOAT_FIELDS = ["temperature", "top_p", "min_p"]
BOOL_FIELDS = ["ignore_eos", "no_stop_trim", "skip_special_tokens"]
WRONG_TYPES = {
    **{f: ["7", 1.5, True, [1], {"v": 1}] for f in INT_FIELDS},
    **{f: ["0.5", True, [0.5], {"v": 1}] for f in FLOAT_FIELDS},
    **{f: ["yes", 1, 0, [True], {"v": 1}] for f in BOOL_FIELDS},
    "stop": [5, {"s": 1}, [5], [""], ""],
    "stop_token_ids": ["x", 1, {"v": 1}, [1.5], [True], [-1], [10**30], [NAN]],
}
TOP_LEVEL = [
    {"input_ids": [-1]}, {"input_ids": [10**30]}, {"input_ids": [1.5]}, {"input_ids": [True]},
    {"input_ids": [NAN]}, {"input_ids": [[1], [10**30]]}, {"input_ids": [[1], []]}, {"input_ids": []},
    {"input_ids": "abc"}, {"input_ids": 5}, {"input_ids": {"a": 1}}, {"text": 5}, {"text": [1]},
    {"text": ""}, {"text": {"a": "b"}}, {"text": "hi", "input_ids": [1]}, {},
    {"input_ids": [1], "sampling_params": "x"}, {"input_ids": [1], "sampling_params": [{}]},
    {"input_ids": [1], "rid": 5}, {"input_ids": [1], "rid": ["a"]}, {"input_ids": [[1], [2]], "rid": ["a", "a"]},
    {"input_ids": [1], "stream": 1}, {"input_ids": [1], "stream": "yes"}, {"input_ids": [1], "return_logprob": 1},
    {"input_ids": [1], "logprob_start_len": 10**30}, {"input_ids": [1], "top_logprobs_num": -5},
    {"input_ids": [1], "lora_path": "x"}, {"input_ids": [[1], [2]], "sampling_params": [{}]},
]  # fmt: skip
CHAT_BAD = [
    {"max_tokens": 10**30}, {"max_tokens": 0}, {"temperature": NAN}, {"seed": -1}, {"seed": 2**64},
    {"top_k": 10**30}, {"top_p": INF}, {"n": 2}, {"stream": True}, {"messages": "hi"}, {"messages": []},
    {"messages": [{"role": "user", "content": "a\ud800"}]}, {"stop_token_ids": [10**30]},
]  # fmt: skip
CONTROL_BAD = [
    ("/abort_request", {"rid": 5}), ("/abort_request", {"abort_all": "yes"}), ("/abort_request", {}),
    ("/pause_generation", {"mode": "sideways"}), ("/pause_generation", {"mode": 5}),
    ("/update_weight_version", {"new_version": ""}), ("/update_weight_version", {"new_version": [1]}),
    ("/update_weight_version", {"new_version": True}), ("/update_weight_version", {"new_version": NAN}),
    ("/update_weights_from_disk", {"model_path": 5}), ("/update_weights_from_disk", {"model_path": ""}),
    ("/update_weights_from_disk", {"model_path": "/x", "weight_version": [1]}),
    ("/update_weights_from_disk", {"model_path": "/x", "load_format": "pt"}),
]  # fmt: skip
BAD_UTF8 = [b"\xff", b"\xc3", b"\x80", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]
WRONG_CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                       "application/xml", "text/html; charset=utf-8"]  # fmt: skip

Case = tuple[str, bytes, str | None]  # (path, body, content-type)


def _dump(body) -> bytes:
    return json.dumps(body).encode()  # NaN and Infinity come out as JavaScript's literals, as clients send them


def _nested(depth: int, rng: random.Random) -> bytes:
    if rng.random() < 0.5:
        return b"[" * depth + b"1" + b"]" * depth
    return b'{"a": ' * depth + b"1" + b"}" * depth


def fuzz_cases(seed: int = 20, n: int = 160) -> list[Case]:
    """Every kind of malformed request at least once, then random ones up to `n`."""
    rng = random.Random(seed)
    cases: list[Case] = []

    def gen(body, ct: str | None = "application/json") -> None:
        cases.append(("/generate", body if isinstance(body, bytes) else _dump(body), ct))

    for field, values in BAD_NUMBERS.items():
        for v in values:
            gen({**SMALL, "sampling_params": {field: v}})
    for field, values in WRONG_TYPES.items():
        for v in values:
            gen({**SMALL, "sampling_params": {field: v}})
    for body in TOP_LEVEL:
        gen(body)
    cases += [("/v1/chat/completions", _dump({**CHAT, **bad}), "application/json") for bad in CHAT_BAD]
    cases += [(path, _dump(body), "application/json") for path, body in CONTROL_BAD]
    for raw in (b"", b"   \n", b"[]", b"1", b'"x"', b"null", b"true", b"{", b"}", b"{}x", b"1" * 5000):
        gen(raw)
    for bad in BAD_UTF8:
        gen(b'{"text": "a' + bad + b'b"}')
    for esc in ("\\ud800", "\\udfff", "a\\ud83d", "\\ude00b"):  # lone surrogates, escaped
        gen(b'{"text": "' + esc.encode() + b'"}')
        gen(b'{"input_ids": [1], "rid": "' + esc.encode() + b'"}')
        gen(b'{"input_ids": [1], "sampling_params": {"stop": ["' + esc.encode() + b'"]}}')
        gen(b'{"' + esc.encode() + b'": 1}')
    for depth in (33, 1000, 100_000):
        gen(b'{"input_ids": [1], "sampling_params": {"stop": ' + _nested(depth, rng) + b"}}")
        gen(_nested(depth, rng))
    for ct in WRONG_CONTENT_TYPES:
        gen(SMALL, ct)
    gen(b"", None)

    valid = _dump(SMALL)
    while len(cases) < n:
        kind = rng.randrange(7)
        if kind == 0:  # an out-of-range number
            field = rng.choice(list(BAD_NUMBERS))
            gen({**SMALL, "sampling_params": {"max_new_tokens": 4, field: rng.choice(BAD_NUMBERS[field])}})
        elif kind == 1:  # a wrong type
            field = rng.choice(list(WRONG_TYPES))
            gen({**SMALL, "sampling_params": {"max_new_tokens": 4, field: rng.choice(WRONG_TYPES[field])}})
        elif kind == 2:  # an unknown field, at the top or in sampling_params
            name = f"zz_{rng.getrandbits(32):08x}"
            gen({**SMALL, name: 1} if rng.random() < 0.5 else {**SMALL, "sampling_params": {name: 1}})
        elif kind == 3:  # truncated: no strict prefix of an object is JSON
            gen(valid[: rng.randrange(1, len(valid))])
        elif kind == 4:  # invalid UTF-8 or a lone surrogate inside a string
            bad = rng.choice(BAD_UTF8 + [b"\\ud800", b"\\udbff"])
            gen(b'{"text": "' + bad + b'", "sampling_params": {"max_new_tokens": 4}}')
        elif kind == 5:  # deep nesting
            gen(b'{"input_ids": ' + _nested(rng.randrange(33, 50_000), rng) + b"}")
        else:  # garbage bytes
            gen(bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 64))))
    return cases


@pytest.fixture(scope="module")
def engine_url(tiny, tmp_path_factory):
    path, _ = tiny
    logs = tmp_path_factory.mktemp("fuzz-logs")
    args = ("--max-running-requests", "8", "--max-total-len", str(MAX_TOTAL_LEN))
    with EngineGroup(str(path), 1, logs, engine_args=args) as pool:
        yield pool.urls[0]


class LongRun:
    """LONG streamed in a thread; `started` is set at its first chunk (it is then running in the engine)."""

    def __init__(self, url: str):
        self.started = threading.Event()
        self.last: dict | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self.thread.start()
        assert self.started.wait(120), "the long generation did not start"
        assert self.error is None, self.error

    def _run(self, url: str) -> None:
        try:
            with httpx.Client(base_url=url, timeout=300) as c:
                with c.stream("POST", "/generate", json={**LONG, "stream": True}) as r:
                    assert r.status_code == 200, r.read()
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            self.last = json.loads(line.removeprefix("data: "))
                            self.started.set()
        except BaseException as e:  # noqa: BLE001 (reported by the test's thread)
            self.error = e
        finally:
            self.started.set()


def test_malformed_requests_get_4xx_and_do_not_disturb_a_running_generation(engine_url):
    cases = fuzz_cases()
    assert len(cases) >= 150
    with httpx.Client(base_url=engine_url, timeout=120) as client:
        alone = client.post("/generate", json=LONG).json()
        assert alone["meta_info"]["finish_reason"] == {"type": "length", "length": 2000}

        runs = [LongRun(engine_url)]
        for path, body, ct in cases:
            if not runs[-1].thread.is_alive():  # keep a generation running through the whole fuzz
                runs.append(LongRun(engine_url))
            r = client.post(path, content=body, headers={} if ct is None else {"content-type": ct})
            what = (path, body[:120], ct)
            assert 400 <= r.status_code < 500, (what, r.status_code, r.text[:300])
            err = r.json()
            assert err["object"] == "error" and err["code"] == r.status_code and err["message"], (what, err)
            assert client.get("/health").status_code == 200, what

        for run in runs:
            run.thread.join()
            assert run.error is None, run.error
            assert run.last["meta_info"]["finish_reason"] == {"type": "length", "length": 2000}
            assert run.last["output_ids"] == alone["output_ids"]
        assert client.get("/health_generate").status_code == 200
        assert client.get("/get_load").json()["num_running_reqs"] == 0
