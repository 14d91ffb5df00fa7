"""User functions for --custom-tis-function-path in the tests (fn(old_logp, rollout_logp, mask, algorithm))."""

import torch


def half_weights(old_logp, rollout_logp, mask, algorithm):
    """Every token weighs 0.5, except tokens whose log-probs differ by more than 1 (weight 0); metrics: the
    per-token |old - rollout| (logged as its token mean, tis_abs_gap) and the weight again (tis_w)."""
    gap = (old_logp - rollout_logp).abs()
    w = torch.where(gap > 1.0, torch.zeros_like(gap), torch.full_like(gap, 0.5))
    return w, {"abs_gap": gap, "tis_w": w}


def plain_weights(old_logp, rollout_logp, mask, algorithm):
    """Weights only (no metrics): the ratio clamped to [0, algorithm.tis_clip]."""
    return torch.exp(old_logp - rollout_logp).clamp(max=algorithm.tis_clip)


def two_args(old_logp, rollout_logp):
    """The wrong signature: --custom-tis-function-path refuses it when the config is read."""
    return torch.ones_like(old_logp)
