"""Megatron GPTModel vs HF Llama: same log-probs, exact weight round trip, CPU training (TP=2 over gloo:
tests/integration/test_megatron_tp2.py).

Models are tiny and built in code (nothing is downloaded); fp32 throughout so 1e-5 is a real bound."""

from __future__ import annotations

import pytest
import torch
from model_helpers import LENGTHS, VOCAB, padded_batch, tiny_config, tiny_hf_model

from sluiceway.models.hf_megatron import (
    hf_to_megatron,
    load_hf_weights,
    megatron_state_dict,
    megatron_to_hf,
    merge_tp_shards,
)
from sluiceway.models.megatron_attention import SDPACoreAttention
from sluiceway.models.megatron_gpt import build_gpt_model, init_parallel_state, transformer_config_from_hf
from sluiceway.models.megatron_logprobs import (
    gpt_logits,
    logprobs_at,
    packed_attention_mask,
    token_logprobs,
    token_logprobs_and_entropy,
)

# megatron-core 0.16 emits DeprecationWarnings for its own defaults (tp_group=None, ffn_hidden_size): not ours.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def hf_logprobs_entropy(model, ids, mask, temperature):
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float() / temperature
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)
    logp = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


@pytest.fixture(scope="module", autouse=True)
def _parallel_state():
    init_parallel_state()
    init_parallel_state()  # idempotent


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logprob_parity_and_round_trip(tied):
    hf = tiny_hf_model(tied)
    gpt = build_gpt_model(hf.config).eval()
    load_hf_weights(gpt, hf)
    ids, mask = padded_batch(LENGTHS)
    valid = mask[:, 1:].bool()  # target position t+1 is a real token
    for temperature in (1.0, 0.7):
        ref_logp, ref_ent = hf_logprobs_entropy(hf, ids, mask, temperature)
        with torch.no_grad():
            logp = token_logprobs(gpt, ids, temperature=temperature)
            logp2, ent = token_logprobs_and_entropy(gpt, ids, temperature=temperature)
        assert logp.shape == (ids.size(0), ids.size(1) - 1) and logp.dtype == torch.float32
        assert (logp - ref_logp)[valid].abs().max().item() <= 1e-5
        assert (ent - ref_ent)[valid].abs().max().item() <= 1e-5
        assert torch.equal(logp, logp2)

    # Megatron -> HF reproduces HF's state dict exactly (same keys, bitwise-equal tensors).
    back = megatron_to_hf(megatron_state_dict(gpt), hf.config)
    ref = hf.state_dict()
    assert set(back) == set(ref)
    for key, tensor in ref.items():
        assert torch.equal(back[key], tensor), key


def test_backward_gives_finite_grads_on_every_parameter():
    hf = tiny_hf_model(tied=False)
    gpt = build_gpt_model(hf.config).train()
    load_hf_weights(gpt, hf)
    ids, mask = padded_batch(LENGTHS)
    logp, ent = token_logprobs_and_entropy(gpt, ids, temperature=0.7)
    valid = mask[:, 1:].float()
    loss = -((logp + 0.01 * ent) * valid).sum() / valid.sum()
    loss.backward()
    for name, p in gpt.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    # One plain torch.optim step (megatron's optimizers are CUDA-only) changes the log-probs.
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
    opt.step()
    with torch.no_grad():
        assert not torch.allclose(token_logprobs(gpt, ids), logp.detach())


def test_tp_sharding_round_trips_through_merge():
    hf = tiny_hf_model(tied=False)
    ref = hf.state_dict()
    full = hf_to_megatron(ref, hf.config)
    shards = [hf_to_megatron(ref, hf.config, tp_rank=r, tp_size=2) for r in range(2)]
    merged = merge_tp_shards(shards, hf.config)
    assert set(merged) == set(full)
    for key in full:
        assert torch.equal(merged[key], full[key]), key
    fc1 = shards[1]["decoder.layers.0.mlp.linear_fc1.weight"]  # rank 1 holds cat(gate_1, up_1)
    gate, up = ref["model.layers.0.mlp.gate_proj.weight"], ref["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate[64:], up[64:]]))


def test_load_rejects_mismatched_keys():
    hf = tiny_hf_model(tied=False)
    gpt = build_gpt_model(hf.config)
    sd = dict(hf.state_dict())
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    with pytest.raises(ValueError, match="does not know"):
        load_hf_weights(gpt, sd, hf.config)
    del sd["model.layers.0.self_attn.q_norm.weight"], sd["model.norm.weight"]
    with pytest.raises(KeyError, match="model.norm.weight"):
        load_hf_weights(gpt, sd, hf.config)


def test_sdpa_core_attention_masks_and_decode():
    """Explicit megatron-style masks and queries shorter than keys (decode) match a direct softmax."""
    config = transformer_config_from_hf(tiny_config(tied=False))
    attn = SDPACoreAttention(config, layer_number=1, attn_mask_type=config_mask_causal())
    s, b, nh, ng, hd = 5, 2, 4, 2, 16
    q, k, v = torch.randn(s, b, nh, hd), torch.randn(s, b, ng, hd), torch.randn(s, b, ng, hd)

    def reference(q, k, v, forbidden):
        qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        kb, vb = kb.repeat_interleave(nh // ng, 1), vb.repeat_interleave(nh // ng, 1)
        scores = (qb @ kb.transpose(-1, -2)) / hd**0.5
        probs = scores.masked_fill(forbidden, float("-inf")).softmax(-1)
        return (probs @ vb).permute(2, 0, 1, 3).reshape(q.size(0), b, nh * hd)

    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    torch.testing.assert_close(attn(q, k, v, None), reference(q, k, v, causal))
    pad = torch.zeros(b, 1, s, s, dtype=torch.bool)
    pad[1, :, :, 3:] = True  # row 1: keys 3.. are padding
    got = attn(q, k, v, pad)
    torch.testing.assert_close(got[:3], reference(q, k, v, causal | pad)[:3])
    # Last two queries against all five keys: causal aligns bottom-right.
    torch.testing.assert_close(attn(q[3:], k, v, None), reference(q, k, v, causal)[3:])


def config_mask_causal():
    from megatron.core.transformer.enums import AttnMaskType

    return AttnMaskType.causal


# ---------------------------------------------------------------------------------------------------------
# TP=2 over gloo (two spawned processes) against TP=1
# ---------------------------------------------------------------------------------------------------------


def test_qwen2_logprob_parity_and_round_trip():
    """Qwen2 differs from Llama by q/k/v biases: they must land in linear_qkv's bias, group by group."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    hf = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))  # non-trivial biases and norms
    gpt = build_gpt_model(hf.config).eval()
    load_hf_weights(gpt, hf)
    ids, mask = padded_batch(LENGTHS)
    valid = mask[:, 1:].bool()
    ref_logp, _ = hf_logprobs_entropy(hf, ids, mask, 1.0)
    with torch.no_grad():
        logp = token_logprobs(gpt, ids)
    assert (logp - ref_logp)[valid].abs().max().item() <= 1e-5
    back = megatron_to_hf(megatron_state_dict(gpt), hf.config)
    assert set(back) == set(hf.state_dict())
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())


def test_skipping_prompt_positions_changes_nothing_the_loss_reads():
    """first_target skips the output layer before a position: same log-probs, entropies and gradients after it."""
    hf = tiny_hf_model(tied=True)
    gpt = build_gpt_model(hf.config).train()
    load_hf_weights(gpt, hf)
    ids, _ = padded_batch(LENGTHS)
    first = 3
    full_logp, full_ent = token_logprobs_and_entropy(gpt, ids, temperature=0.7)
    (full_logp[:, first:].sum() + full_ent[:, first:].sum()).backward()
    full_grads = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    gpt.zero_grad()
    logp, ent = token_logprobs_and_entropy(gpt, ids, temperature=0.7, first_target=first)
    assert logp.shape == full_logp.shape and not logp[:, :first].any() and not ent[:, :first].any()
    assert torch.allclose(logp[:, first:], full_logp[:, first:], atol=1e-6)
    assert torch.allclose(ent[:, first:], full_ent[:, first:], atol=1e-6)
    (logp[:, first:].sum() + ent[:, first:].sum()).backward()
    for n, p in gpt.named_parameters():
        assert torch.allclose(p.grad, full_grads[n], atol=1e-5, rtol=1e-4), n
    with torch.no_grad():  # past the end it falls back to the last position
        assert torch.allclose(token_logprobs(gpt, ids, 0.7, first_target=10_000)[:, -1], full_logp[:, -1].detach())


def test_logits_at_needed_positions_only_change_nothing_the_loss_reads():
    """`needed` computes the output layer only where a loss reads: same values and gradients there, zeros elsewhere."""
    hf = tiny_hf_model(tied=True)
    gpt = build_gpt_model(hf.config).train()
    load_hf_weights(gpt, hf)
    ids, _ = padded_batch(LENGTHS)
    needed = torch.rand(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(5)) < 0.4
    w = torch.randn(needed.shape, generator=torch.Generator().manual_seed(6))
    full_logp, full_ent = token_logprobs_and_entropy(gpt, ids, temperature=0.7)
    ((full_logp * w)[needed].sum() + full_ent[needed].sum()).backward()
    full_grads = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    gpt.zero_grad()
    logp, ent = token_logprobs_and_entropy(gpt, ids, temperature=0.7, needed=needed)
    assert logp.shape == full_logp.shape and not logp[~needed].any() and not ent[~needed].any()
    assert torch.allclose(logp[needed], full_logp[needed], atol=1e-6)
    assert torch.allclose(ent[needed], full_ent[needed], atol=1e-6)
    ((logp * w)[needed].sum() + ent[needed].sum()).backward()
    for n, p in gpt.named_parameters():
        assert torch.allclose(p.grad, full_grads[n], atol=1e-5, rtol=1e-4), n


def test_responses_sharing_one_prompt_score_as_in_rows_of_their_own():
    """One row [prompt, r1, r2, pad]: r2 continues from the prompt's end (RoPE positions) and attends to the prompt
    and itself only, so log-probs, entropies and gradients equal those of the rows [prompt r1] and [prompt r2]."""
    hf = tiny_hf_model(tied=False)
    gpt = build_gpt_model(hf.config).train()
    load_hf_weights(gpt, hf)
    g = torch.Generator().manual_seed(3)
    prompt, r1, r2 = (torch.randint(1, VOCAB, (n,), generator=g) for n in (6, 4, 3))
    separate = torch.zeros(2, 10, dtype=torch.long)
    separate[0], separate[1, :9] = torch.cat([prompt, r1]), torch.cat([prompt, r2])
    ref_logp, ref_ent = token_logprobs_and_entropy(gpt, separate, temperature=0.7)
    rows, cols = torch.tensor([0] * 4 + [1] * 3), torch.tensor([5, 6, 7, 8, 5, 6, 7])  # positions predicting r1, r2
    (ref_logp[rows, cols].sum() + ref_ent[rows, cols].sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    gpt.zero_grad()

    shared = torch.cat([prompt, r1, r2, torch.zeros(1, dtype=torch.long)]).unsqueeze(0)
    positions = torch.tensor([[*range(10), *range(6, 9), 0]])
    segments = torch.tensor([[0] * 13 + [-1]])
    members = torch.tensor([[-1] * 6 + [0] * 4 + [1] * 3 + [-1]])
    mask = packed_attention_mask(segments, members)
    at = torch.tensor([5, 6, 7, 8, 5, 10, 11])  # the prompt's last token predicts both first tokens
    targets = torch.cat([r1, r2])
    logp, ent = logprobs_at(gpt, shared, torch.zeros(7, dtype=torch.long), at, targets, 0.7, mask, positions)
    torch.testing.assert_close(logp, ref_logp[rows, cols].detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, ref_ent[rows, cols].detach(), atol=1e-6, rtol=0)
    (logp.sum() + ent.sum()).backward()
    for n, p in gpt.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], atol=1e-5, rtol=1e-4, msg=n)
    with torch.no_grad():  # megatron memoises RoPE per length: positions set once must not leak into later calls
        plain = gpt_logits(gpt, shared)
        gpt_logits(gpt, shared, mask, position_ids=positions)
        torch.testing.assert_close(gpt_logits(gpt, shared), plain, atol=0, rtol=0)
