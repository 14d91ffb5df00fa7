"""The embedded rollout engine in process: its forward against transformers, packed weights, its scheduler (seeds,
batching, abort, streaming), bf16 attention and shared prefills. SGLang's HTTP API served by a real process:
tests/integration/test_engine_server.py."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sluiceway.models.engine import Engine, GenerateRequest, SamplingParams, packed_linear
from sluiceway.models.engine.core import stream
from sluiceway.models.engine.kv_cache import SlotKVCache
from sluiceway.models.engine.llama import LlamaRunner, attention
from sluiceway.models.zoo import load_hf_model, load_hf_state_dict, resolve_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

LONG = 1500  # tokens: long enough (seconds) that short requests provably finish while it runs


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sluiceway-cache")


@pytest.fixture(scope="module")
def model_dir(cache_dir) -> Path:
    return resolve_checkpoint("tiny-llama", cache_dir=cache_dir)


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


def _wait(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------------- core, no HTTP


def test_forward_matches_transformers_with_slot_cache(model_dir):
    hf = load_hf_model(model_dir)
    runner = LlamaRunner(hf.config, load_hf_state_dict(model_dir))
    ids = torch.randint(3, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits.float()
    assert (runner.forward_full(ids) - ref).abs().max() <= 1e-4
    # Two rows of different lengths prefilled into their own slots, then decoded together.
    cache = SlotKVCache(runner.n_layers, 2, runner.n_kv, 64, runner.head_dim)
    # Prefilled together as one right-padded batch.
    last = runner.prefill(cache, 0, [ids[0, :14], ids[1, :5]])
    assert (last[0] - ref[0, 13]).abs().max() <= 1e-4 and (last[1] - ref[1, 4]).abs().max() <= 1e-4
    for step in range(6):
        pos = torch.tensor([14 + step, 5 + step])
        out = runner.decode(cache, torch.stack([ids[0, pos[0]], ids[1, pos[1]]]), pos)
        assert (out[0] - ref[0, pos[0]]).abs().max() <= 1e-4
        assert (out[1] - ref[1, pos[1]]).abs().max() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_compute_what_plain_weights_do(model_dir, dtype):
    """oneDNN-packed matrices (the engine's CPU default) against F.linear: a tied Llama and an untied Qwen2 with
    q/k/v biases, through a full forward, a padded prefill and decode steps."""
    # Probed per dtype: oneDNN packs bf16 only on CPUs with AVX-512 (bw/vl/dq) or AVX-NE-CONVERT.
    if not packed_linear.available(dtype):
        pytest.skip(f"oneDNN's packed linear ops do not run in {dtype} on this CPU (the engine uses F.linear)")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=300,
            tie_word_embeddings=False,
        )
    )
    with torch.no_grad():
        for name, p in qwen.named_parameters():
            if name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    models = [(load_hf_model(model_dir).config, load_hf_state_dict(model_dir)), (qwen.config, qwen.state_dict())]
    tol = 1e-4 if dtype == torch.float32 else 0.0  # bf16 accumulates in fp32 both ways: identical here
    for config, sd in models:
        plain = LlamaRunner(config, sd, dtype=dtype, pack_weights=False)
        packed = LlamaRunner(config, sd, dtype=dtype, pack_weights=True)
        assert packed.packed and "lm_head.weight" in packed.packed and not plain.packed
        ids = torch.randint(3, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        assert (packed.forward_full(ids) - plain.forward_full(ids)).abs().max() <= tol
        caches = [SlotKVCache(r.n_layers, 2, r.n_kv, 32, r.head_dim, dtype) for r in (plain, packed)]
        a, b = (r.prefill(c, 0, [ids[0, :9], ids[1, :4]]) for r, c in zip((plain, packed), caches))
        assert (a - b).abs().max() <= tol
        for step in range(3):
            pos = torch.tensor([9 + step, 4 + step])
            tokens = torch.stack([ids[0, pos[0]], ids[1, pos[1]]])
            a, b = (r.decode(c, tokens, pos) for r, c in zip((plain, packed), caches))
            assert (a - b).abs().max() <= tol


def test_core_seeds_batching_abort_and_stream(model_dir):
    engine = Engine(model_dir, max_running_requests=4, max_total_len=512)
    try:

        def req(prompt, seed, n=24, rid=None):
            return GenerateRequest(prompt, SamplingParams(max_new_tokens=n, sampling_seed=seed, ignore_eos=True), rid)

        alone = engine.generate([req([5, 6, 7], 11)])[0]
        # More requests than slots: some wait, join later, and land in different slots.
        batch = engine.generate(
            [req([9, 8], 1, 40), req([3] * 7, 2, 3), req([5, 6, 7], 11), req([4], 3, 9), req([7, 7], 4)]
        )
        assert batch[2].output_ids == alone.output_ids
        assert batch[2].output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)
        assert [len(o.output_ids) for o in batch] == [40, 3, 24, 9, 24]
        assert all(o.finish_reason == {"type": "length", "length": len(o.output_ids)} for o in batch)

        chunks = list(stream(engine, req([5, 6, 7], 11)))
        assert len(chunks) >= 2 and chunks[-1].output is not None
        assert sum((c.token_ids for c in chunks), []) == alone.output_ids

        handle = engine.submit(req([1, 2, 3], 5, LONG, rid="core-long"))
        _wait(lambda: engine.load()["num_running_reqs"] == 1 and engine.stats["generated_tokens"] > 0)
        assert engine.abort("core-long") == 1
        out = handle.result(timeout=30)
        assert out.finish_reason["type"] == "abort" and 0 < len(out.output_ids) < LONG
        assert len(out.output_logprobs) == len(out.output_ids)
    finally:
        engine.shutdown()


def test_bf16_attention_matches_sdpa_in_fp32():
    """The explicit bf16 attention (decode with a per-row mask, causal prefill, padded prefill) is SDPA's math."""
    g = torch.Generator().manual_seed(0)
    cases = [  # (rows, queries, keys, mask)
        (5, 1, 30, (torch.arange(30)[None, :] <= torch.tensor([29, 3, 17, 0, 22])[:, None])[:, None, None, :]),
        (3, 12, 12, None),
        (2, 9, 9, torch.ones(9, 9, dtype=torch.bool).tril()[None, None] & (torch.arange(9) < 6)),
    ]
    for b, t, s, mask in cases:
        q, k, v = (torch.randn(b, heads, n, 16, generator=g) for heads, n in ((6, t), (2, s), (2, s)))
        if mask is not None:
            mask = mask | torch.eye(t, s, dtype=torch.bool)  # no fully masked rows (SDPA would give NaN)
        q16, k16, v16 = (x.bfloat16() for x in (q, k, v))
        got = attention(q16, k16, v16, mask, 0.25)
        assert got.dtype == torch.bfloat16 and got.shape == (b, 6, t, 16)
        kw = {"is_causal": True} if mask is None else {"attn_mask": mask}
        ref = F.scaled_dot_product_attention(q16.float(), k16.float(), v16.float(), enable_gqa=True, scale=0.25, **kw)
        assert (got.float() - ref).abs().max() <= 2e-2, (b, t, s)


def test_requests_with_one_prompt_share_its_prefill(model_dir, other_weights):
    engine = Engine(model_dir, max_running_requests=8, max_total_len=LONG + 64)
    try:

        def req(prompt, seed, n=16):
            return GenerateRequest(prompt, SamplingParams(max_new_tokens=n, sampling_seed=seed, ignore_eos=True))

        p, q = [5, 6, 7, 8, 9], [40, 41]
        outs = engine.generate([req(p, 1), req(q, 9), req(p, 2), req(p, 3), req(p, 4)])
        # The n samples of one prompt: one prefill, the other three copy its KV.
        assert engine.stats["prefill_tokens"] == len(p) + len(q)
        assert engine.stats["shared_prefill_tokens"] == 3 * len(p)
        for o, seed in zip([outs[0], *outs[2:]], [1, 2, 3, 4]):
            alone = engine.generate([req(p, seed)])[0]
            assert o.output_ids == alone.output_ids
            assert o.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)
        assert len({tuple(o.output_ids) for o in outs}) == 5

        # A running row's prompt is not shared once the weights change under it.
        long = engine.submit(req(p, 7, LONG))
        _wait(lambda: engine.load()["num_running_reqs"] == 1 and engine.stats["generated_tokens"] > 0)
        engine.update_weights_from_disk(other_weights, "1")
        shared_before = engine.stats["shared_prefill_tokens"]
        during = engine.generate([req(p, 5)])[0]
        assert engine.stats["shared_prefill_tokens"] == shared_before
        engine.abort(abort_all=True)
        long.result(timeout=30)
        assert during.output_ids == engine.generate([req(p, 5)])[0].output_ids
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------------------------------- HTTP API
