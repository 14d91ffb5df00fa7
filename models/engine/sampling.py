"""Per-row sampling: temperature, top-k, top-p, min-p, and inverse-CDF draws from one generator per row.

Each row owns a torch.Generator seeded by its request's `sampling_seed` and draws one uniform number per
generated token (the old sampler's Gumbel-max drew one vector per token), so a request's tokens depend only
on its seed (and the model), never on which other requests share the batch or when it joined.

Log-probs are those of the temperature-scaled distribution, log_softmax(logits / T) in fp32, *before* top-k,
top-p and min-p truncation: the quantity the trainer recomputes (`token_logprobs`), so the PPO ratio starts at 1.
Temperature 0 means greedy: the argmax, reported with the log-prob under the unscaled distribution (T = 1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from sluiceway.models.fused_logprobs import sampled_logprobs

TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"


def truncation_mask(logprobs: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor | None:
    """Boolean [b, vocab] of tokens removed by top-k / top-p / min-p, or None when no row truncates.

    top-p keeps the smallest prefix of the sorted distribution whose mass reaches top_p (the most likely
    token always stays); min-p drops tokens with p < min_p * p_max.
    """
    vocab = logprobs.shape[-1]
    need_sort = bool(((top_k < vocab) | (top_p < 1.0)).any())
    need_min_p = bool((min_p > 0).any())
    if not (need_sort or need_min_p):
        return None
    drop = torch.zeros_like(logprobs, dtype=torch.bool)
    if need_sort:
        sorted_lp, order = logprobs.sort(dim=-1, descending=True)
        sorted_p = sorted_lp.exp()
        ranks = torch.arange(vocab)[None, :]
        drop_sorted = ranks >= top_k[:, None]
        drop_sorted |= (sorted_p.cumsum(-1) - sorted_p) >= top_p[:, None]
        drop_sorted[:, 0] = False  # even when top_p underflows to 0 in fp32
        drop.scatter_(-1, order, drop_sorted)
    if need_min_p:
        p = logprobs.exp()
        drop |= p < (min_p[:, None] * p.max(dim=-1, keepdim=True).values)
    return drop


def inverse_cdf_draw(probs: Tensor, generators: list[torch.Generator]) -> Tensor:
    """One token per row from unnormalised `probs` [b, vocab], using one uniform from the row's generator.

    Inverse-CDF needs one random number per row and step (Gumbel-max needs a vocabulary's worth, which
    dominated the step time at a 49k vocabulary); the sample still depends only on the row's seed.
    """
    u = torch.cat([torch.rand(1, generator=g) for g in generators])
    cdf = probs.cumsum(-1)
    target = (u * cdf[:, -1])[:, None]
    # The first index whose cumulative mass exceeds the target (zero-probability tokens never qualify).
    return (cdf <= target).sum(-1).clamp_(max=probs.shape[-1] - 1)


def sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    generators: list[torch.Generator],
) -> tuple[Tensor, Tensor]:
    """(token ids [b], log-probs [b]) for fp32 logits [b, vocab]; one generator per row (see module doc)."""
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits.float() / scale[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    if bool(greedy.all()):
        tokens = logprobs.argmax(dim=-1)
    else:
        probs = logprobs.exp()
        drop = truncation_mask(logprobs, top_k, top_p, min_p)
        if drop is not None:
            probs = probs.masked_fill(drop, 0.0)
        # A request's settings are fixed for its life, so greedy rows drawing or not never changes what
        # any sampled row draws.
        tokens = torch.where(greedy, logprobs.argmax(dim=-1), inverse_cdf_draw(probs, generators))
    # The reported log-prob is the trainer's formula of the same logits (models/fused_logprobs.py), which differs
    # from log_softmax's in the last bits: the same bits on both sides (issue 31).
    return tokens, sampled_logprobs(scaled, tokens)
