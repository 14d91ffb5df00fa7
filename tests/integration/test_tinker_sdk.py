"""The real Tinker SDK (tinker==0.38.0, pinned in pyproject.toml) against `sluiceway tinker serve` on tiny-llama:
one server for the file (its start is most of the cost), a LoRA training client whose cross-entropy loss falls
over a few forward_backward + optim_step calls, saved sampler weights sampled with log-probs, the
importance_sampling, ppo and cispo losses, and an unimplemented call answered with an error that names it.
Last, the server is killed with SIGKILL and started again on the same store: a finished request's future still
answers, the same ServiceClient resumes from save_state with create_training_client_from_state(_with_optimizer),
and every request and sample is a row of the store's Delta tables."""

from __future__ import annotations

import os

import httpx
import pytest
from tinker_helpers import CLIENT_ENV, TinkerServer

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.skipif(tinker.__version__ != "0.38.0", reason="the wire format is 0.38.0's")


@pytest.fixture(scope="module")
def server(tmp_path_factory, module_cache):
    srv = TinkerServer(tmp_path_factory.mktemp("tinker"), module_cache).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def service(server):
    os.environ.update(CLIENT_ENV)
    client = tinker.ServiceClient(base_url=server.url)
    yield client
    client.close("success").result()


def datum(tokens: list[int], weights: list[float] | None = None):
    from tinker import types

    weights = weights if weights is not None else [1.0] * (len(tokens) - 1)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def test_lora_trains_saves_and_samples(service):
    from tinker import types

    tc = service.create_lora_training_client(base_model="tiny-llama", rank=4).result()
    tok = tc.get_tokenizer()  # offline: the server names its local model directory
    batch = [datum(tok.encode("The cat sat on the mat.")), datum(tok.encode("One two three four five six"))]
    losses = []
    for _ in range(4):
        fb = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        out = fb.result()
        opt.result()
        losses.append(out.metrics["loss:sum"])
        assert len(out.loss_fn_outputs) == 2
        assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == len(batch[0].model_input.to_ints())
    assert losses[-1] < losses[0] - 1.0, losses

    saved = tc.save_weights_for_sampler("step-4").result()
    assert saved.path.startswith("tinker://") and saved.path.endswith("/sampler_weights/step-4")
    sc = service.create_sampling_client(model_path=saved.path).result()
    prompt = types.ModelInput.from_ints(tok.encode("The cat"))
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    res = sc.sample(prompt, num_samples=2, sampling_params=params, include_prompt_logprobs=True).result()
    assert len(res.sequences) == 2
    for seq in res.sequences:
        assert 1 <= len(seq.tokens) <= 6 and len(seq.logprobs) == len(seq.tokens)
        assert all(lp <= 0 for lp in seq.logprobs) and seq.stop_reason in ("stop", "length")
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == prompt.length
    again = sc.sample(prompt, num_samples=2, sampling_params=params).result()  # the seed repeats the samples
    assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]

    lps = sc.compute_logprobs(prompt).result()  # the prompt's log-probs, as prompt_logprobs gave them
    assert lps[0] is None and lps[1:] == pytest.approx(res.prompt_logprobs[1:], abs=1e-5)
    fwd = tc.forward(batch, "cross_entropy").result()  # no backward: the loss is the last step's weights'
    assert fwd.metrics["loss:sum"] < losses[-1]

    # importance_sampling on the sampled tokens, with the sampler's log-probs (the trainer's own policy here)
    seq = res.sequences[0]
    full = prompt.to_ints() + list(seq.tokens)
    n_prompt = prompt.length
    is_datum = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": full[1:],
            "logprobs": [0.0] * (n_prompt - 1) + list(seq.logprobs),
            "advantages": [0.0] * (n_prompt - 1) + [1.0] * len(seq.tokens),
        },
    )
    is_out = tc.forward_backward([is_datum], "importance_sampling").result()
    # the ratio p/q is about 1 at the sampling policy: the loss is about -(number of sampled tokens)
    assert is_out.metrics["loss:sum"] == pytest.approx(-len(seq.tokens), rel=0.05)
    # ppo: inside its clip range the same; cispo: -sum(ratio * logp * A), about -sum(sampled log-probs)
    ppo = tc.forward([is_datum], "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}).result()
    assert ppo.metrics["loss:sum"] == pytest.approx(-len(seq.tokens), rel=0.05)
    cispo = tc.forward([is_datum], "cispo").result()
    assert cispo.metrics["loss:sum"] == pytest.approx(-sum(seq.logprobs), rel=0.05, abs=0.05)


def test_unimplemented_call_names_itself(service):
    tc = service.create_lora_training_client(base_model="tiny-llama", rank=2).result()
    with pytest.raises(Exception, match="does not implement the loss function 'dro'"):
        tc.forward_backward([datum([1, 5, 9])], "dro").result()
    with pytest.raises(Exception, match="clip_ratio"):
        tc.forward_backward([datum([1, 5, 9])], "ppo", {"clip_ratio": 0.2}).result()


def test_no_request_reaches_the_weights_with_nan_or_a_ruinous_optimizer_step(service):
    """Issue 52 points 2 and 3 through the real SDK: NaN in a datum or a loss setting, and AdamParams out of bounds,
    are the caller's errors naming the field; an optim_step after them changes nothing it should not, and the
    weights stay finite (a forward after them gives the same finite loss)."""
    from tinker import types

    tc = service.create_lora_training_client(base_model="tiny-llama", rank=2).result()
    tok = tc.get_tokenizer()
    good = datum(tok.encode("Finite numbers only, please."))
    before = tc.forward([good], "cross_entropy").result().metrics["loss:sum"]

    ids = tok.encode("Finite numbers only, please.")
    nan_weights = datum(ids, weights=[float("nan")] * (len(ids) - 1))
    with pytest.raises(Exception, match=r"loss_fn_inputs\['weights'\] must be finite numbers"):
        tc.forward_backward([nan_weights], "cross_entropy").result()
    n = len(good.model_input.to_ints())
    ppo = types.Datum(
        model_input=good.model_input,
        loss_fn_inputs={
            "target_tokens": good.loss_fn_inputs["target_tokens"],
            "logprobs": [-1.0] * n,
            "advantages": [1.0] * n,
        },
    )
    with pytest.raises(Exception, match=r"loss_fn_config\['clip_low_threshold'\] must be a finite number"):
        tc.forward_backward([ppo], "ppo", {"clip_low_threshold": float("nan")}).result()
    ruinous = [
        (dict(learning_rate=1e30), "adam_params.learning_rate must be a finite number in \\[0, 1\\]"),
        (dict(learning_rate=-1.0), "adam_params.learning_rate must be"), (dict(eps=0.0, beta2=0.0), "adam_params.eps"),
        (dict(beta1=5.0), "adam_params.beta1 must be"), (dict(grad_clip_norm=-1.0), "adam_params.grad_clip_norm"),
        (dict(learning_rate=float("inf")), "400 .*learning_rate"),  # the SDK sends inf as null: not a number
    ]  # fmt: skip
    for bad, says in ruinous:
        with pytest.raises(Exception, match=says):
            tc.optim_step(types.AdamParams(**bad)).result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # nothing was accumulated: nothing moves
    assert tc.forward([good], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(before, abs=1e-6)


def test_hostile_bodies_are_answered_4xx_and_leave_no_traceback(server, service):
    """Issue 52 points 9 and 10 with raw HTTP: bad JSON, a list, 100k-deep nesting on the JSON routes, a chunked
    body past the bound, num_samples of 400 digits, max_tokens 0: each a 4xx naming what is wrong, the server's log
    free of tracebacks, and the server still serving."""
    url = f"{server.url}/api/v1"
    deep = b"[" * 100_000 + b"]" * 100_000
    for route in ("asample", "unload_model", "create_session", "optim_step"):
        for body, says in ((b"{not json", "not JSON"), (b"[1, 2]", "must be a JSON object"), (deep, "nested")):
            r = httpx.post(f"{url}/{route}", content=body, headers={"content-type": "application/json"}, timeout=30)
            assert r.status_code == 400 and says in r.json()["error"], (route, r.status_code, r.text[:300])
    r = httpx.post(f"{url}/sessions/session-0/finish", content=b"[]", timeout=30)
    assert r.status_code in (400, 404), r.text

    def chunks():  # no Content-Length: counted as it streams
        for _ in range(70):
            yield b" " * (1 << 20)

    r = httpx.post(f"{url}/asample", content=chunks(), timeout=60)
    assert r.status_code == 413 and "at most" in r.json()["error"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    huge = {"num_samples": 10**400, "prompt": prompt, "sampling_params": {"max_tokens": 4}, "base_model": "tiny-llama"}
    r = httpx.post(f"{url}/asample", json=huge, timeout=30)
    assert r.status_code == 400 and "num_samples must be between 1 and" in r.json()["error"], r.text[:300]
    zero = {"num_samples": 1, "prompt": prompt, "sampling_params": {"max_tokens": 0}, "base_model": "tiny-llama"}
    r = httpx.post(f"{url}/asample", json=zero, timeout=30)
    assert r.status_code == 400 and "max_tokens must be at least 1" in r.json()["error"], r.text[:300]
    assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    assert "Traceback" not in server.log_text()


@pytest.mark.filterwarnings("ignore:DEPRECATED. TrainingClient.load_state:FutureWarning")  # still the SDK's API
def test_killed_server_restarts_from_its_store(server, service):
    """Train two steps, save_state, one more step (the uninterrupted run); SIGKILL; start again on the store."""
    from tinker import types
    from tinker.proto.response_conv import deserialize_forward_backward_output

    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.tinker import read_requests, read_samples

    adam = types.AdamParams(learning_rate=1e-2)
    tc = service.create_lora_training_client(base_model="tiny-llama", rank=4).result()
    tok = tc.get_tokenizer()
    batch = [datum(tok.encode("A kill and a restart.")), datum(tok.encode("Seven eight nine ten"))]
    first = tc.forward_backward(batch, "cross_entropy").result()
    tc.optim_step(adam).result()
    tc.forward_backward(batch, "cross_entropy").result()
    tc.optim_step(adam).result()
    saved = tc.save_state("two-steps").result()
    assert saved.path == f"tinker://{tc.model_id}/weights/two-steps"
    at_save = tc.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    tc.forward_backward(batch, "cross_entropy").result()
    tc.optim_step(adam).result()
    uninterrupted = tc.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    with pytest.raises(Exception, match="saved already"):
        tc.save_state("two-steps").result()

    # A sampled sequence of this test's own (the file's earlier tests sample too; this one does not lean on them).
    sampler = tc.save_weights_for_sampler("restart").result().path
    sc = service.create_sampling_client(model_path=sampler).result()
    prompt = types.ModelInput.from_ints(tok.encode("A kill"))
    sc.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=4, seed=3)).result()

    store = ObjectStore.from_uri(str(server.store))
    rows = read_requests(store, "it").to_pylist()
    mine = [r for r in rows if r["model_id"] == tc.model_id]
    assert [r["request_type"] for r in mine][:6] == ["create_model", "forward_backward", "optim_step",
                                                      "forward_backward", "optim_step", "save_weights"]  # fmt: skip
    first_row = mine[1]
    assert first_row["loss"] == pytest.approx(first.metrics["loss:sum"]) and first_row["loss_fn"] == "cross_entropy"
    assert first_row["num_datums"] == 2 and first_row["status"] == "ok" and first_row["seq_id"] == 1
    assert [r["request_type"] for r in mine][-2:] == ["save_weights", "save_weights_for_sampler"]
    assert mine[-2]["status"] == "error" and "saved already" in mine[-2]["error"]
    assert {"asample", "forward"} <= {r["request_type"] for r in rows}
    mine_sampled = [r for r in read_samples(store, "it").to_pylist() if r["sampler_path"] == sampler]
    assert len(mine_sampled) == 2 and all(1 <= len(r["output_token_ids"]) <= 4 for r in mine_sampled)

    server.kill()
    server.start()

    # a request finished before the kill answers as it did
    got = httpx.post(f"{server.url}/api/v1/retrieve_future", json={"request_id": first_row["request_id"]}, timeout=30)
    assert got.status_code == 200, got.text
    assert deserialize_forward_backward_output(got.content).metrics["loss:sum"] == first.metrics["loss:sum"]
    lost = httpx.post(f"{server.url}/api/v1/retrieve_future", json={"request_id": "req-" + "0" * 32}, timeout=30)
    assert lost.status_code == 404

    # the same ServiceClient (its session is on the store) resumes from the saved state
    resumed = service.create_training_client_from_state_with_optimizer(saved.path).result()
    assert resumed.get_info().lora_rank == 4
    assert resumed.forward(batch, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(at_save, rel=1e-5)
    resumed.forward_backward(batch, "cross_entropy").result()
    resumed.optim_step(adam).result()
    after = resumed.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    assert after == pytest.approx(uninterrupted, rel=1e-4)  # Adam's moments came back with the weights
    weights_only = service.create_training_client_from_state(saved.path).result()
    assert weights_only.forward(batch, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(at_save, rel=1e-5)
    weights_only.forward_backward(batch, "cross_entropy").result()
    weights_only.optim_step(adam).result()  # a fresh Adam: not the uninterrupted run's step
    fresh = weights_only.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    assert fresh != pytest.approx(uninterrupted, rel=1e-4)
    weights_only.load_state_with_optimizer(saved.path).result()  # load_state into an existing model
    assert weights_only.forward(batch, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(at_save, rel=1e-5)
    with pytest.raises(Exception, match="LoRA rank 4"):
        service.create_lora_training_client(base_model="tiny-llama", rank=2).result().load_state(saved.path).result()
    rows = read_requests(store, "it").to_pylist()
    assert [r["request_type"] for r in rows if r["model_id"] == resumed.model_id][:1] == ["load_weights"]
