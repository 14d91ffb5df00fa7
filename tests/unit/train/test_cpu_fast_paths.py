"""The trainer's CPU fast paths compute what the plain torch ops they replace compute, values and gradients.

- `token_logprob_entropy` (models/fused_logprobs.py) against log_softmax + gather and the entropy of softmax;
- the explicit causal attention of models/megatron_gpt.py against SDPA;
- the gradient norm (vector_norm) against the sum of squares.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sluiceway.models.fused_logprobs as fused
from sluiceway.models.fused_logprobs import token_logprob_entropy
from sluiceway.models.megatron_attention import _explicit_attention_pays, _explicit_causal_attention
from sluiceway.tasks.train.parallel import grad_norm


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("which", ["logp", "entropy", "both"])
def test_fused_logprobs_values_and_gradients(monkeypatch, temperature, which):
    monkeypatch.setattr(fused, "CHUNK_ROWS", 4)  # several chunks and a ragged last one
    g = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(5, 3, 97, generator=g)).requires_grad_()
    targets = torch.randint(0, 97, (5, 3), generator=g)
    w_logp, w_ent = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)

    logp, ent = token_logprob_entropy(logits, targets, temperature)
    ref_logp, ref_ent = _reference(logits, targets, temperature)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == (5, 3)
    assert (logp.double() - ref_logp).abs().max() < 1e-5 and (ent.double() - ref_ent).abs().max() < 1e-5

    def loss(lp, h):
        return {"logp": (lp * w_logp).sum(), "entropy": (h * w_ent).sum(), "both": (lp * w_logp + h * w_ent).sum()}[
            which
        ]

    (got,) = torch.autograd.grad(loss(logp, ent), logits)
    (want,) = torch.autograd.grad(loss(ref_logp, ref_ent), logits)
    assert (got.double() - want).abs().max() < 1e-5


def test_fused_logprobs_keep_the_logits_dtype_for_the_gradient():
    logits = torch.randn(6, 50, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 50, (6,))
    logp, _ = token_logprob_entropy(logits, targets)
    logp.sum().backward()
    ref_logp, _ = _reference(logits.float(), targets, 1.0)
    assert logits.grad.dtype == torch.bfloat16
    assert (logp.double() - ref_logp).abs().max() < 1e-5  # bf16 logits, fp32 softmax: no loss of precision


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_explicit_causal_attention_matches_sdpa(packed):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 11, 16, generator=g, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    assert _explicit_attention_pays(q, 11, None, 0.0)
    assert not _explicit_attention_pays(q.float(), 11, None, 0.0)  # fp32: SDPA is as fast
    assert not _explicit_attention_pays(q, 11, None, 0.1)  # dropout: SDPA's
    allowed = torch.ones(11, 11, dtype=torch.bool).tril()
    forbidden = None
    if packed:  # two samples in each row (the second from position 5), neither sees the other
        segments = (torch.arange(11) >= 5).long().expand(2, 11)
        forbidden = (segments.unsqueeze(-1) != segments.unsqueeze(-2)).unsqueeze(1)
        allowed = allowed & ~forbidden
        assert _explicit_attention_pays(q, 11, forbidden, 0.0)
    out = _explicit_causal_attention(q, k, v, 0.25, forbidden)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=allowed, scale=0.25)
    assert (out.float() - ref).abs().max() < 2e-2
    grad_out = torch.randn(ref.shape, generator=g)
    out.backward(grad_out.bfloat16())
    ref.backward(grad_out)
    for a, b in ((q, qf), (k, kf), (v, vf)):
        assert (a.grad.float() - b.grad).abs().max() < 5e-2


def test_grad_norm_is_the_norm_of_all_gradients():
    g = torch.Generator().manual_seed(3)
    params = [torch.zeros(7, 5), torch.zeros(300, dtype=torch.bfloat16), torch.zeros(2)]  # the last has no grad
    for p in params[:2]:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    want = torch.cat([p.grad.double().flatten() for p in params[:2]]).norm()
    from sluiceway.models.megatron_gpt import init_parallel_state

    init_parallel_state()
    assert abs(float(grad_norm(params, [False] * 3)) - float(want)) < 1e-4
