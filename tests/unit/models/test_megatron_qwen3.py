"""Qwen3 on Megatron GPTModel (per-head q/k RMSNorm, explicit head_dim): parity, TP sharding, gradients at DP=1
(DP=2 over gloo: tests/integration/test_megatron_qwen3_dp2.py).

Tiny models built in code, fp32 throughout, so 1e-5 is a real bound."""

from __future__ import annotations

import pytest
import torch
from model_helpers import padded_batch
from qwen3_helpers import HEAD_DIM, LENGTHS, TEMPERATURE, masked_loss, qwen3_config, qwen3_model
from transformers import Qwen3Config

from sluiceway.models.hf_megatron import (
    hf_to_megatron,
    load_hf_weights,
    megatron_state_dict,
    megatron_to_hf,
    merge_tp_shards,
)
from sluiceway.models.megatron_gpt import (
    allreduce_gradients,
    build_gpt_model,
    init_parallel_state,
    transformer_config_from_hf,
)
from sluiceway.models.megatron_logprobs import token_logprobs, token_logprobs_and_entropy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module", autouse=True)
def _parallel_state():
    init_parallel_state()


def test_qwen3_config_and_qk_norm_modules():
    cfg = qwen3_config()
    tc = transformer_config_from_hf(cfg)
    assert tc.qk_layernorm and tc.kv_channels == HEAD_DIM and not tc.add_qkv_bias
    gpt = build_gpt_model(cfg)
    attn = gpt.decoder.layers[0].self_attention
    for norm in (attn.q_layernorm, attn.k_layernorm):
        assert isinstance(norm, torch.nn.RMSNorm)
        assert norm.normalized_shape == (HEAD_DIM,) and norm.eps == cfg.rms_norm_eps
    with pytest.raises(NotImplementedError, match="attention_bias"):
        transformer_config_from_hf(Qwen3Config(**{**qwen3_config().to_dict(), "attention_bias": True}))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_qwen3_logprob_grad_parity_and_round_trip(tied):
    hf = qwen3_model(tied)
    gpt = build_gpt_model(hf.config).eval()
    load_hf_weights(gpt, hf)
    ids, mask = padded_batch(LENGTHS)
    valid = mask[:, 1:].float()

    logits = hf(input_ids=ids, attention_mask=mask).logits.float() / TEMPERATURE
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)
    ref_logp = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    masked_loss(ref_logp, ref_ent, valid, int(valid.sum())).backward()

    logp, ent = token_logprobs_and_entropy(gpt, ids, temperature=TEMPERATURE)
    masked_loss(logp, ent, valid, int(valid.sum())).backward()
    sel = valid.bool()
    assert (logp - ref_logp).detach()[sel].abs().max().item() <= 1e-5
    assert (ent - ref_ent).detach()[sel].abs().max().item() <= 1e-5
    with torch.no_grad():
        assert torch.equal(token_logprobs(gpt, ids, temperature=TEMPERATURE), logp.detach())

    # HF gradients mapped like weights equal the GPTModel gradients (q/k norms included).
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    mapped = hf_to_megatron(hf_grads, hf.config)
    for name, p in gpt.named_parameters():
        torch.testing.assert_close(p.grad, mapped[name], atol=1e-5, rtol=1e-4, msg=name)
    assert mapped["decoder.layers.1.self_attention.k_layernorm.weight"].abs().sum() > 0

    # HF -> Megatron -> HF is bit-exact, q_norm / k_norm included.
    back = megatron_to_hf(megatron_state_dict(gpt), hf.config)
    ref = hf.state_dict()
    assert set(back) == set(ref)
    for key, tensor in ref.items():
        assert torch.equal(back[key], tensor), key


def test_qwen3_tp_sharding_round_trip():
    hf = qwen3_model()
    ref = hf.state_dict()
    full = hf_to_megatron(ref, hf.config)
    assert full["decoder.layers.0.self_attention.q_layernorm.weight"].shape == (HEAD_DIM,)
    assert full["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * HEAD_DIM, 64)
    assert full["decoder.layers.0.self_attention.linear_proj.weight"].shape == (64, 4 * HEAD_DIM)
    shards = [hf_to_megatron(ref, hf.config, tp_rank=r, tp_size=2) for r in range(2)]
    for shard in shards:  # per-head norms are replicated, not split
        assert torch.equal(
            shard["decoder.layers.0.self_attention.k_layernorm.weight"], ref["model.layers.0.self_attn.k_norm.weight"]
        )
    merged = merge_tp_shards(shards, hf.config)
    assert set(merged) == set(full) and all(torch.equal(merged[k], full[k]) for k in full)
    back = megatron_to_hf(shards, hf.config)
    assert all(torch.equal(back[k], v) for k, v in ref.items())
    with pytest.raises(ValueError, match="tp_size=4"):  # 2 KV heads cannot split 4 ways
        hf_to_megatron(ref, hf.config, tp_rank=0, tp_size=4)


def test_allreduce_gradients_is_a_noop_at_dp1():
    gpt = build_gpt_model(qwen3_config())
    for p in gpt.parameters():
        p.grad = torch.full_like(p, 2.0)
    allreduce_gradients(gpt)
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in gpt.parameters())


# ---------------------------------------------------------------------------------------------------------
# DP=2 (two spawned processes, gloo, TP=1) against one process on the full batch
# ---------------------------------------------------------------------------------------------------------
