"""Policy-gradient losses on per-token log-probs. All tensors are [batch, tokens]; mask is 1 on trained tokens."""

from __future__ import annotations

import torch


def ppo_clip_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate (to minimise) and whether the clip was active."""
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).float()


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1/k2/k3)."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        # k3 = r - 1 - log r with r = ref/policy: unbiased and >= 0. low_var_kl clamps it for stability.
        neg = (-log_ratio).clamp(-20, 20) if kind == "low_var_kl" else -log_ratio
        k3 = torch.exp(neg) - 1 - neg
        return k3.clamp(max=10.0) if kind == "low_var_kl" else k3
    raise ValueError(f"unknown KL estimator {kind!r}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, denom: float) -> torch.Tensor:
    """Reduce per-token losses to a scalar for a micro-batch that is part of a larger global batch.

    token_mean: sum over all trained tokens of the global batch / their count (`denom` = token count).
    seq_mean_token_mean: mean per sequence, then sum / `denom` (= sequences in the global batch).
    """
    if mode == "token_mean":
        return (per_token * mask).sum() / max(denom, 1.0)
    if mode == "seq_mean_token_mean":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / max(denom, 1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}")
