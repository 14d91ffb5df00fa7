"""The embedded rollout engine's SGLang HTTP API, served by a real process.

The server runs `sluiceway engine` in a subprocess on a loopback port this module picks, is waited for on
/health and stopped by pid. The model is the zoo's tiny-llama, built into a temporary cache."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from sluiceway.infra.proc import free_port
from sluiceway.models.zoo import load_hf_state_dict, load_tokenizer, resolve_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

LONG = 1500  # tokens: long enough (seconds) that short requests provably finish while it runs


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sluiceway-cache")


@pytest.fixture(scope="module")
def model_dir(cache_dir) -> Path:
    return resolve_checkpoint("tiny-llama", cache_dir=cache_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def other_weights(model_dir, tmp_path_factory) -> Path:
    """A copy of the model with perturbed weights (what a trainer step would write)."""
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("tiny-v1") / "model"
    shutil.copytree(model_dir, out)
    g = torch.Generator().manual_seed(7)
    sd = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in load_hf_state_dict(model_dir).items()}
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def server(model_dir, cache_dir):
    port = free_port()
    env = {**os.environ, "SLUICEWAY_CACHE": str(cache_dir)}
    cmd = [sys.executable, "-m", "sluiceway.flows.cli", "engine", "--model", "tiny-llama", "--port", str(port),
           "--max-running-requests", "8", "--max-total-len", "2048"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited with {proc.returncode}: {proc.stdout.read().decode()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("engine did not become healthy in 120 s")
            time.sleep(0.2)
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the group is the server alone
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _gen(client: httpx.Client, **body) -> dict | list:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("result", fn(*args, **kwargs)), daemon=True)
    t.start()
    return t, box


def _wait(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------------- core, no HTTP


# ---------------------------------------------------------------------------------------------- HTTP API


def test_generate_by_text_and_ids_single_and_batched(server, tokenizer, model_dir):
    sp = {"max_new_tokens": 8, "sampling_seed": 3, "ignore_eos": True}
    one = _gen(server, text="What is 2 + 3?", sampling_params=sp)
    assert set(one) >= {"text", "output_ids", "meta_info"} and len(one["output_ids"]) == 8
    meta = one["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == len(tokenizer("What is 2 + 3?")["input_ids"]) and meta["completion_tokens"] == 8
    assert meta["weight_version"] == "0" and "e2e_latency" in meta and "output_token_logprobs" not in meta
    by_ids = _gen(server, input_ids=tokenizer("What is 2 + 3?")["input_ids"], sampling_params=sp)
    assert by_ids["output_ids"] == one["output_ids"] and by_ids["text"] == one["text"]

    batch = _gen(server, text=["What is 2 + 3?", "Hello"], sampling_params=sp, rid=["a1", "a2"])
    assert [b["meta_info"]["id"] for b in batch] == ["a1", "a2"] and batch[0]["output_ids"] == one["output_ids"]
    ids_batch = _gen(server, input_ids=[[5, 6, 7], [8]], sampling_params=[sp, {**sp, "max_new_tokens": 3}])
    assert [len(b["output_ids"]) for b in ids_batch] == [8, 3]

    info = server.get("/model_info").json()
    assert info["model_path"] == str(model_dir) and info["is_generation"] is True
    assert server.get("/get_model_info").json() == info
    assert server.get("/server_info").json()["max_running_requests"] == 8
    assert server.get("/health_generate").status_code == 200
    assert server.get("/v1/models").json()["data"][0]["id"] == "tiny-llama"


def test_logprobs_match_megatron_trainer(server, model_dir):
    from transformers import AutoConfig

    from sluiceway.models.hf_megatron import load_hf_weights
    from sluiceway.models.megatron_gpt import build_gpt_model, init_parallel_state
    from sluiceway.models.megatron_logprobs import token_logprobs

    init_parallel_state()
    cfg = AutoConfig.from_pretrained(model_dir)
    gpt = build_gpt_model(cfg)
    load_hf_weights(gpt, load_hf_state_dict(model_dir), cfg)
    gpt.eval()
    prompt = [272, 260, 223, 20, 275, 223, 21, 33]
    cases = [
        ({"temperature": 0.7, "sampling_seed": 5}, 0.7),
        ({"temperature": 1.0, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "sampling_seed": 6}, 1.0),  # pre-truncation
        ({"temperature": 0.0}, 1.0),  # greedy: log-probs of the unscaled distribution
    ]
    for sp, temp in cases:
        out = _gen(server, input_ids=prompt, return_logprob=True,
                   sampling_params={**sp, "max_new_tokens": 16, "ignore_eos": True})  # fmt: skip
        triples = out["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in triples] == out["output_ids"]
        with torch.no_grad():
            ref = token_logprobs(gpt, torch.tensor([prompt + out["output_ids"]]), temperature=temp)[
                0, len(prompt) - 1 :
            ]
        assert torch.tensor([lp for lp, _, _ in triples]).sub(ref).abs().max() <= 1e-4, sp


def test_same_seed_same_tokens_alone_or_batched(server):
    sp = {"max_new_tokens": 30, "sampling_seed": 42, "ignore_eos": True, "temperature": 1.0}
    alone = _gen(server, input_ids=[11, 12, 13], sampling_params=sp, return_logprob=True)
    batch = _gen(
        server,
        input_ids=[[50, 51], [11, 12, 13], [7] * 20],
        sampling_params=[{**sp, "sampling_seed": 1}, sp, {**sp, "sampling_seed": 2, "max_new_tokens": 9}],
        return_logprob=True,
    )
    assert batch[1]["output_ids"] == alone["output_ids"]
    assert batch[0]["output_ids"] != alone["output_ids"]
    other = _gen(server, input_ids=[11, 12, 13], sampling_params={**sp, "sampling_seed": 43})
    assert other["output_ids"] != alone["output_ids"]


def test_continuous_batching_short_requests_finish_while_long_runs(server):
    before = server.get("/get_load").json()
    long_t, long_box = _in_thread(
        _gen, server, input_ids=[5, 6], rid="cb-long", sampling_params={"max_new_tokens": LONG, "ignore_eos": True}
    )
    _wait(lambda: server.get("/get_load").json()["num_running_reqs"] >= 1)
    shorts = [_gen(server, input_ids=[9 + i], sampling_params={"max_new_tokens": 4 + i, "ignore_eos": True})
              for i in range(3)]  # fmt: skip
    # The short requests were admitted after the long one started and finished before it: the long request is
    # still running, and the engine ran two at once.
    assert [len(s["output_ids"]) for s in shorts] == [4, 5, 6]
    load = server.get("/get_load").json()
    assert long_t.is_alive() and load["num_running_reqs"] == 1
    assert load["max_running_requests_seen"] >= 2 and load["finished_requests"] >= before["finished_requests"] + 3
    long_t.join(60)
    assert long_box["result"]["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}


def test_abort_one_rid_returns_partial_tokens(server):
    t, box = _in_thread(
        _gen, server, input_ids=[5, 6], rid="to-abort", return_logprob=True,
        sampling_params={"max_new_tokens": LONG, "ignore_eos": True},
    )  # fmt: skip
    _wait(lambda: server.get("/get_load").json()["num_running_reqs"] >= 1)
    time.sleep(0.05)
    assert server.post("/abort_request", json={"rid": "to-abort"}).status_code == 200
    t.join(30)
    out = box["result"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < out["meta_info"]["completion_tokens"] == len(out["output_ids"]) < LONG
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])


def test_pause_keeps_state_and_continue_resumes(server):
    t, box = _in_thread(_gen, server, input_ids=[5, 6], sampling_params={"max_new_tokens": 600, "ignore_eos": True})
    _wait(lambda: server.get("/get_load").json()["num_running_reqs"] >= 1)
    assert server.post("/pause_generation", json={}).json()["status"] == "ok"
    q, qbox = _in_thread(_gen, server, input_ids=[8], sampling_params={"max_new_tokens": 3})
    _wait(lambda: server.get("/get_load").json()["num_waiting_reqs"] == 1)
    frozen = server.get("/get_load").json()["generated_tokens"]
    time.sleep(0.3)
    load = server.get("/get_load").json()
    assert load["generated_tokens"] == frozen and load["paused"] and t.is_alive() and q.is_alive()
    assert server.get("/health").status_code == 200
    assert server.post("/continue_generation").json()["status"] == "ok"
    t.join(60)
    q.join(60)
    assert box["result"]["meta_info"]["finish_reason"] == {"type": "length", "length": 600}
    assert len(qbox["result"]["output_ids"]) <= 3


def test_stop_token_ids_and_stop_strings(server, tokenizer):
    base = {"max_new_tokens": 40, "sampling_seed": 17, "ignore_eos": True}  # seeded: replays exactly
    full = _gen(server, input_ids=[40, 41, 42], sampling_params=base)["output_ids"]
    k = next(i for i in range(3, 30) if full[i] > 2 and full[i] not in full[:i])
    out = _gen(server, input_ids=[40, 41, 42], sampling_params={**base, "stop_token_ids": [full[k]]})
    assert out["output_ids"] == full[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": full[k]}

    full_text = tokenizer.decode(full, skip_special_tokens=True)
    stop = next(s for i in range(3, 30) if (s := tokenizer.decode(full[i : i + 2])).strip() and full_text.find(s) > 0)
    out = _gen(server, input_ids=[40, 41, 42], sampling_params={**base, "stop": stop})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full_text[: full_text.find(stop)]
    kept = _gen(server, input_ids=[40, 41, 42], sampling_params={**base, "stop": [stop], "no_stop_trim": True})
    assert kept["text"].endswith(stop) and kept["output_ids"] == out["output_ids"]


def test_streaming(server):
    sp = {"max_new_tokens": 12, "sampling_seed": 9, "ignore_eos": True}
    whole = _gen(server, input_ids=[5, 6, 7], sampling_params=sp)
    events = []
    with server.stream("POST", "/generate", json={"input_ids": [5, 6, 7], "sampling_params": sp, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_openai_chat_completions(server):
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "What is 2 + 3?"}],
            "max_tokens": 6, "seed": 1, "temperature": 0.7, "logprobs": True}  # fmt: skip
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    assert out["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["finish_reason"] in ("stop", "length")
    assert 0 < out["usage"]["completion_tokens"] <= 6
    assert len(choice["logprobs"]["content"]) == out["usage"]["completion_tokens"]
    assert server.post("/v1/chat/completions", json={**body, "messages": []}).status_code == 400


BAD_GENERATE = [
    {"input_ids": [1, 2], "sampling_params": {"bogus": 1}},
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}, "stream": True},  # scoring is not streamed
    {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2},  # past the input
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -3}},
    {"input_ids": [1, 99999]},
    {"input_ids": [1, -1]},
    {"text": ""},
    {"input_ids": []},
    {"input_ids": [[1], []]},
    {"sampling_params": {"max_new_tokens": 3}},
    {"input_ids": [1], "sampling_params": {"temperature": -1}},
    {"input_ids": [1], "sampling_params": {"top_p": 0}},
    {"input_ids": [1], "sampling_params": {"stop_token_ids": [5000]}},
    {"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}},
    {"input_ids": [1], "unknown_field": 1},
    {"input_ids": [[1], [2]], "rid": ["same", "same"]},
]


def test_bad_input_is_400_and_engine_keeps_serving(server):
    for body in BAD_GENERATE:
        r = server.post("/generate", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["message"], body
    for raw in ('{"input_ids": [1,', "", "[1, 2]"):
        r = server.post("/generate", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, raw
    r = server.post("/update_weights_from_disk", json={"model_path": "/nonexistent/model", "weight_version": "9"})
    assert r.status_code == 400 and r.json()["success"] is False and "nonexistent" in r.json()["message"]
    assert server.post("/abort_request", json={}).status_code == 400
    assert server.get("/health").status_code == 200
    assert server.get("/model_info").json()["weight_version"] == "0"
    assert len(_gen(server, input_ids=[1, 2], sampling_params={"max_new_tokens": 2})["output_ids"]) <= 2


def test_update_weights_from_disk_changes_outputs_and_version(server, model_dir, other_weights):
    sp = {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True}
    before = _gen(server, input_ids=[30, 31, 32], sampling_params=sp)
    r = server.post("/update_weights_from_disk", json={"model_path": str(other_weights), "weight_version": "1"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    after = _gen(server, input_ids=[30, 31, 32], sampling_params=sp)
    assert after["output_ids"] != before["output_ids"] and after["meta_info"]["weight_version"] == "1"
    assert server.get("/model_info").json()["weight_version"] == "1"
    assert server.get("/flush_cache").status_code == 200
    r = server.post("/update_weights_from_disk", json={"model_path": str(model_dir), "weight_version": "2"})
    assert r.json()["success"] is True
    again = _gen(server, input_ids=[30, 31, 32], sampling_params=sp)
    assert again["output_ids"] == before["output_ids"] and again["meta_info"]["weight_version"] == "2"
    assert server.post("/update_weight_version", json={"new_version": "3"}).json()["new_version"] == "3"
    assert server.get("/get_model_info").json()["weight_version"] == "3"


def test_a_client_that_goes_away_frees_its_rid(server):
    """A killed or timed-out client's request is aborted when its connection closes: the same rid (a resumed run
    sends the same rids) is taken again, not refused as 'already in use'."""
    body = {"input_ids": [5, 6], "rid": "goes-away", "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    with httpx.Client(base_url=str(server.base_url), timeout=httpx.Timeout(60, read=0.5)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/generate", json=body)  # the connection closes with the timeout
    _wait(lambda: server.get("/get_load").json()["num_running_reqs"] == 0)
    again = _gen(server, input_ids=[5, 6], rid="goes-away", sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert again["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
