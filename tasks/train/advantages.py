"""From per-sample rewards to per-sample advantages (broadcast over the response tokens).

grpo:  (r - mean_group) / (std_group + eps)                -- Shao et al., DeepSeekMath
dr_grpo: r - mean_group                                     -- Liu et al., "Dr. GRPO" (no std scaling)
reinforce_plus_plus_baseline: r - mean_group, then whitened over the whole batch
"""

from __future__ import annotations

import torch

EPS = 1e-6


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, estimator: str = "grpo", normalize_by_std: bool = True
) -> torch.Tensor:
    """rewards, group_ids: [n]. Samples sharing a group id are answers to the same prompt."""
    rewards = rewards.double()
    adv = torch.empty_like(rewards)
    for g in group_ids.unique():
        idx = group_ids == g
        r = rewards[idx]
        centred = r - r.mean()
        if estimator == "grpo" and normalize_by_std:
            # unbiased=False: a group of identical rewards gives 0/eps = 0, never NaN.
            centred = centred / (r.std(unbiased=False) + EPS)
        adv[idx] = centred
    if estimator == "reinforce_plus_plus_baseline":
        adv = (adv - adv.mean()) / (adv.std(unbiased=False) + EPS)
    elif estimator not in ("grpo", "dr_grpo"):
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    return adv.float()
