"""The real Tinker SDK (tinker==0.38.0, pinned in pyproject.toml) against `sluiceway tinker serve` on tiny-llama:
one server for the file (its start is most of the cost), a LoRA training client whose cross-entropy loss falls
over a few forward_backward + optim_step calls, saved sampler weights sampled with log-probs, the
importance_sampling loss, and an unimplemented call answered with an error that names it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from sluiceway.infra.proc import free_port  # noqa: E402

pytestmark = pytest.mark.skipif(tinker.__version__ != "0.38.0", reason="the wire format is 0.38.0's")


@pytest.fixture(scope="module")
def server(tmp_path_factory, warm_cache):
    base = tmp_path_factory.mktemp("tinker")
    port = free_port()
    env = dict(os.environ, SLUICEWAY_CACHE=str(warm_cache), HF_HUB_OFFLINE="1", TINKER_TELEMETRY="0")
    cmd = [sys.executable, "-m", "sluiceway.flows.cli", "tinker", "serve", "--base-model", "tiny-llama",
           "--port", str(port), "--work-dir", str(base / "work")]  # fmt: skip
    log = open(base / "server.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, (base / "server.log").read_text()
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        raise AssertionError("the server did not answer: " + (base / "server.log").read_text())
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


@pytest.fixture(scope="module")
def service(server):
    os.environ.update(TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1", TINKER_API_KEY="tml-local")
    client = tinker.ServiceClient(base_url=server)
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


def test_unimplemented_call_names_itself(service):
    tc = service.create_lora_training_client(base_model="tiny-llama", rank=2).result()
    with pytest.raises(Exception, match="does not implement save_weights"):
        tc.save_state("ckpt").result()
    with pytest.raises(Exception, match="ppo"):
        tc.forward_backward([datum([1, 5, 9])], "ppo").result()
