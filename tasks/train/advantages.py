"""From per-sample rewards to per-sample advantages (broadcast over the response tokens).

Each formula, its paper and how slime, verl and TRL compute it: docs/algorithms.md.

grpo:  (r - mean_group) / (std_group + eps), std with Bessel's correction (n - 1), as slime, verl and TRL
                                                            -- Shao et al., DeepSeekMath
dr_grpo: r - mean_group                                     -- Liu et al., "Dr. GRPO" (no std scaling)
rloo:  r_i - mean_{j != i} r_j  (leave-one-out baseline)    -- Kool et al. 2019; Ahmadian et al. 2024
reinforce_plus_plus_baseline: r - mean_group broadcast to the sample's trained tokens, then whitened over every
                              trained token of the batch (a sample weighs its length)  -- Hu et al. 2025

Token-level estimators ([batch, tokens] in and out; see each docstring for the formula):
terminal_rewards: a per-sequence reward placed on the last trained token
gae: Generalised Advantage Estimation with a critic (PPO), returning (advantages, value targets)
reinforce_pp_returns: REINFORCE++ -- KL-shaped discounted returns, whitened over the batch's trained tokens
masked_whiten: whitening over the tokens where mask == 1

Batch whitening (`whitening_scale`, used by all three whitened estimators) is slime's and verl's: mean and
Bessel-corrected variance over the trained tokens, (x - mean) / sqrt(var + 1e-8).

For the trainer (`token_advantages`, below): it plans its micro-batches first, then `token_advantages` overwrites
each micro-batch's broadcast advantages with per-token ones (ppo, reinforce_plus_plus); the PPO-clip loss (dual
clip, TIS, KL loss, entropy, aggregation) then runs on them unchanged. Per-token rewards are the sample's reward on
its last trained token minus `kl_coef` x KL(policy || reference) on every trained token (slime's reward-side KL;
the policy log-probs are the trainer's, before the step). Whitening is over every trained token of the rollout,
all data-parallel ranks together (sums all-reduced), so a micro-batch's advantages do not depend on how the batch
was split. The critic whose values GAE reads is tasks/train/critic.py's `Critic`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from sluiceway.tasks.train.losses import kl_penalty

if TYPE_CHECKING:
    from sluiceway.flows.config import AlgorithmConfig
    from sluiceway.tasks.train.collation import MicroBatch

EPS = 1e-6  # GRPO's std: (r - mean) / (std + EPS), as slime and verl (TRL adds 1e-4)
WHITEN_EPS = 1e-8  # batch whitening: (x - mean) / sqrt(var + WHITEN_EPS), as slime and verl

# Estimators whose advantages are per token and computed by the trainer (they need the critic's values or the
# reference's log-probs), not per sample by `group_advantages`.
TOKEN_LEVEL_ESTIMATORS = ("ppo", "reinforce_plus_plus")


def rloo_advantages(r: torch.Tensor) -> torch.Tensor:
    """RLOO: REINFORCE with the leave-one-out baseline (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline
    for Free!"; Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization ... in LLMs").

    For the n rewards r_1..r_n of one group (answers to the same prompt), each sample's baseline is the mean of the
    OTHER n - 1 rewards, so the baseline does not depend on the sample's own action (unbiased):
        A_i = r_i - (1/(n-1)) * sum_{j != i} r_j
            = r_i - (n * mean - r_i) / (n-1)
            = n/(n-1) * (r_i - mean),                  mean = (1/n) * sum_j r_j
    i.e. Dr. GRPO's centred reward scaled by n/(n-1). No division by the group's std: `normalize_advantages_by_std`
    does not apply to rloo (it is GRPO's option). A group of one sample has no other sample to form a baseline: its
    advantage is 0 (as grpo and dr_grpo give a singleton group).
    """
    n = r.numel()
    if n < 2:
        return torch.zeros_like(r)
    return r - (r.sum() - r) / (n - 1)


def whitening_scale(count: float, sum_sq_dev: float) -> float:
    """1 / sqrt(var + WHITEN_EPS) of `count` values whose squared deviations from their mean sum to `sum_sq_dev`.

    The variance is Bessel-corrected (divided by count - 1), as slime's `distributed_masked_whiten` and verl's
    `masked_whiten`; one value has variance 0. Values all equal give (x - mean) = 0 exactly: never NaN.
    """
    var = sum_sq_dev / (count - 1.0) if count >= 2 else 0.0
    return (var + WHITEN_EPS) ** -0.5


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    estimator: str = "grpo",
    normalize_by_std: bool = True,
    token_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """rewards, group_ids: [n]. Samples sharing a group id are answers to the same prompt.

    token_counts: [n], each sample's trained (loss-mask) tokens; reinforce_plus_plus_baseline needs them, since its
    batch whitening is over tokens (a sample of 12 trained tokens weighs 12, one of 1 weighs 1).
    """
    rewards = rewards.double()
    adv = torch.empty_like(rewards)
    for g in group_ids.unique():
        idx = group_ids == g
        r = rewards[idx]
        if estimator == "rloo":
            adv[idx] = rloo_advantages(r)
            continue
        centred = r - r.mean()
        if estimator == "grpo" and normalize_by_std:
            # The sample std (n - 1), as slime, verl and TRL. A group of one has no spread (its centred reward is
            # 0, its n - 1 std undefined): 0. Identical rewards give 0 / EPS = 0.
            centred = centred / (r.std() + EPS) if r.numel() > 1 else torch.zeros_like(r)
        adv[idx] = centred
    if estimator == "reinforce_plus_plus_baseline":
        adv = whiten_over_tokens(adv, token_counts)
    elif estimator not in ("grpo", "dr_grpo", "rloo"):
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    return adv.float()


def whiten_over_tokens(values: torch.Tensor, token_counts: torch.Tensor | None) -> torch.Tensor:
    """reinforce_plus_plus_baseline's batch whitening of per-sample values, weighted by each sample's trained
    tokens (a sample of 12 trained tokens weighs 12, one of 1 weighs 1)."""
    if token_counts is None or token_counts.shape != values.shape:
        raise ValueError("reinforce_plus_plus_baseline whitens over tokens: pass each sample's token_counts")
    w = token_counts.double()  # each sample's value stands for w tokens of equal advantage
    values = values.double()
    n = float(w.sum())
    mean = float((w * values).sum()) / max(n, 1.0)
    return (values - mean) * whitening_scale(n, float((w * (values - mean).square()).sum()))


# ---------------------------------------------------------------------------------------------------------------------
# Token-level estimators. All per-token tensors are [batch, tokens]; `mask` is 1 on trained (policy) tokens and 0 on
# padding and on tokens the policy did not produce (prompt, tool / environment output in a multi-turn episode).
#
# Masked tokens in the middle of a response are *skipped*, not treated as terminal: the recursion runs over the trained
# tokens only, so the "next step" of a trained token is the next trained token of the same row (its time index does
# not count the masked tokens in between, i.e. discounting is per policy action). Masked tokens get advantage 0 and
# return 0. A reward that sits on a masked token is added, undiscounted, to the nearest trained token before it (the
# action that led to it); a reward on masked tokens before the first trained token of a row is dropped.
# ---------------------------------------------------------------------------------------------------------------------


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + WHITEN_EPS) over the tokens where mask == 1 (`whitening_scale`: Bessel-corrected
    variance, as slime and verl); 0 elsewhere.

    shift_mean=False rescales without centring: x / sqrt(var + WHITEN_EPS) (the variance is still about the mean).
    """
    m = mask.to(x.dtype)
    n = float(m.sum())
    mean = float((x * m).sum()) / max(n, 1.0)
    out = (x - mean) if shift_mean else x
    return out * whitening_scale(n, float(((x - mean) * m).square().sum())) * m


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar reward on its last trained token.

    rewards: [b]; mask: [b, t] -> [b, t] with out[i, last(i)] = rewards[i], last(i) = max{t : mask[i, t] = 1},
    zero elsewhere (a row with no trained token gets no reward).
    """
    m = mask > 0
    t = mask.shape[-1]
    pos = torch.arange(t, device=mask.device).expand_as(m)
    last = torch.where(m, pos, torch.full_like(pos, -1)).max(dim=-1).values  # [b], -1 for an empty row
    out = torch.zeros(mask.shape, dtype=rewards.dtype if rewards.is_floating_point() else torch.float32)
    out = out.to(mask.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards[rows].to(out.dtype)
    return out


@torch.no_grad()
def gae(
    rewards_per_token: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten_advantages: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al., "High-Dimensional Continuous Control Using GAE") for PPO.

    Over the trained tokens t of a row, with n(t) the next trained token (none after the last one):
        delta_t = r_t + gamma * V_{n(t)} - V_t          (V_{n(t)} = 0 after the last trained token)
        A_t     = delta_t + gamma * lam * A_{n(t)}       (A_{n(t)} = 0 after the last trained token)
        R_t     = A_t + V_t                               (value target; computed before any whitening)
    lam = 1 gives Monte-Carlo returns minus values, A_t = sum_k gamma^k r_{t+k} - V_t; lam = 0 gives the one-step TD
    error A_t = delta_t. Masked tokens are skipped (see the module note above) and get A = R = 0. Inputs are treated
    as constants (no gradient). With whiten_advantages the advantages are whitened over the trained tokens of the
    batch (masked_whiten); the returns are not. Per-sequence rewards go through `terminal_rewards` first.
    Returns (advantages [b, t], returns [b, t]).
    """
    m = mask > 0
    dtype = values.dtype if values.is_floating_point() else torch.float32
    r = rewards_per_token.to(dtype)
    v = values.detach().to(dtype)
    b, t = v.shape
    adv = torch.zeros_like(v)
    next_v = v.new_zeros(b)
    next_a = v.new_zeros(b)
    pending = v.new_zeros(b)  # rewards seen on masked tokens after the current position
    for i in range(t - 1, -1, -1):
        mi = m[:, i]
        delta = r[:, i] + pending + gamma * next_v - v[:, i]
        a = delta + gamma * lam * next_a
        adv[:, i] = torch.where(mi, a, torch.zeros_like(a))
        next_v = torch.where(mi, v[:, i], next_v)
        next_a = torch.where(mi, a, next_a)
        pending = torch.where(mi, torch.zeros_like(pending), pending + r[:, i])
    mf = m.to(dtype)
    returns = (adv + v) * mf
    if whiten_advantages:
        adv = masked_whiten(adv, mf)
    return adv, returns


@torch.no_grad()
def reinforce_pp_returns(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    whiten: bool = True,
) -> torch.Tensor:
    """REINFORCE++ advantages (Hu, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs", 2025).

    KL-shaped token reward, on trained tokens only:  r_t = -kl_coef * kl_t + [t = last trained token] * rewards[i]
    Discounted return over the trained tokens:        G_t = r_t + gamma * G_{n(t)}   (G = 0 after the last one)
    Global batch whitening over all trained tokens:    A_t = (G_t - mean(G)) / sqrt(var(G) + 1e-8),  A = 0 on masked
    tokens (mean and Bessel-corrected variance over every trained token of the batch: no critic, no per-prompt
    baseline).
    kl: [b, t] per-token KL estimate to the reference (e.g. `losses.kl_penalty(..., "k1")` of the rollout policy), or
    None for no shaping. Masked tokens are skipped as in `gae` (this is `gae` with V = 0 and lam = 1, then whitened).
    whiten=False returns the returns G (the caller whitens them over a batch spread over several tensors or ranks).
    """
    m = mask.to(torch.float32)
    r = terminal_rewards(rewards.to(torch.float32), mask)
    if kl is not None and kl_coef:
        r = r - kl_coef * kl.detach().to(torch.float32) * m
    returns, _ = gae(r, torch.zeros_like(r), m, gamma=gamma, lam=1.0)
    return masked_whiten(returns, m) if whiten else returns


# ---------------------------------------------------------------------------------------------------------------------
# Sums over the data-parallel group (a no-op on one rank)
# ---------------------------------------------------------------------------------------------------------------------


def _dp_reduce(t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    # Imported here: batch.py builds samples with this module in the flow's process, which never loads megatron.
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_world_size() > 1:
        dist.all_reduce(t, op=op, group=parallel_state.get_data_parallel_group())
    return t


def _masked_sums(xs: list[torch.Tensor], masks: list[torch.Tensor], *fns: Callable) -> list[float]:
    """[count, sum fn_1(x), sum fn_2(x), ...] over the masked tokens of every tensor, all DP ranks, float64."""
    rows = [torch.stack([m.double().sum()] + [(f(x).double() * m).sum() for f in fns]) for x, m in zip(xs, masks)]
    return _dp_reduce(torch.stack(rows).sum(0) if rows else torch.zeros(len(fns) + 1, dtype=torch.float64)).tolist()


def whiten(xs: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """`masked_whiten` over several tensors (and DP ranks) at once: one mean and variance."""
    n, s = _masked_sums(xs, masks, lambda x: x)
    mean = s / max(n, 1.0)
    _, sq = _masked_sums(xs, masks, lambda x: (x.double() - mean).square())
    scale = whitening_scale(n, sq)
    return [((x.double() - mean) * scale * m).to(x.dtype) for x, m in zip(xs, masks)]


def _masked_extremes(xs: list[torch.Tensor], masks: list[torch.Tensor]) -> tuple[float, float]:
    """(min, max) over the masked tokens of every tensor, all DP ranks (a rank may hold no tokens: +-inf)."""
    hi = max((float(x[m > 0].max()) for x, m in zip(xs, masks) if (m > 0).any()), default=-math.inf)
    lo = min((float(x[m > 0].min()) for x, m in zip(xs, masks) if (m > 0).any()), default=math.inf)
    t = _dp_reduce(torch.tensor([hi, -lo], dtype=torch.float64), dist.ReduceOp.MAX).tolist()
    return (-t[1], t[0]) if math.isfinite(t[0]) else (0.0, 0.0)


# ---------------------------------------------------------------------------------------------------------------------
# Token-level advantages for the trainer, over its micro-batches
# ---------------------------------------------------------------------------------------------------------------------

LogProbFn = Callable[["MicroBatch"], torch.Tensor]


class ValueModel(Protocol):
    """What GAE needs of the critic (tasks/train/critic.py: `Critic`): per-token values of a micro-batch."""

    def values(self, mb: MicroBatch) -> torch.Tensor: ...


@dataclass
class ValueTargets:
    """What the critic regresses on, per micro-batch, in the per-sample layout [n, w-1]."""

    old_values: torch.Tensor  # the critic's values before this rollout's updates (the clip's centre)
    returns: torch.Tensor  # GAE returns A + V, before whitening


def reward_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate on the trained tokens, no gradient."""
    return kl_penalty(logp.detach().float(), ref_logp.detach().float(), kl_type) * mask


@torch.no_grad()
def token_advantages(
    steps: list[list[MicroBatch]],
    algorithm: AlgorithmConfig,
    policy_logp: LogProbFn,
    ref_logp: LogProbFn | None,
    critic: ValueModel | None,
    old_logps: list[list[torch.Tensor] | None] | None = None,
) -> tuple[list[list[ValueTargets]] | None, dict[str, float]]:
    """Overwrite every micro-batch's `advantages` with per-token ones (whitened over the rollout); return the
    critic's targets (ppo; grouped like `steps`) and metrics. `old_logps`: the policy's log-probs per micro-batch
    when the trainer already has them (else `policy_logp` computes them, only when kl_coef > 0)."""
    a = algorithm
    batches = [mb for st in steps for mb in st]
    olds = [lp for st, lps in zip(steps, old_logps or [None] * len(steps)) for lp in (lps or [None] * len(st))]
    masks = [mb.loss_mask for mb in batches]
    shaping = a.kl_coef > 0
    if shaping and ref_logp is None:
        raise ValueError("kl_coef > 0 needs the reference model's log-probs")
    kls = [
        reward_kl(old if old is not None else policy_logp(mb), ref_logp(mb), mb.loss_mask, a.kl_loss_type)
        if shaping
        else torch.zeros_like(mb.loss_mask)
        for mb, old in zip(batches, olds)
    ]
    metrics: dict[str, float] = {}
    targets = None
    if a.advantage_estimator == "ppo":
        if critic is None:
            raise ValueError("advantage_estimator ppo needs a critic")
        values = [critic.values(mb) for mb in batches]
        rewards = [terminal_rewards(mb.rewards, mb.loss_mask) - a.kl_coef * kl for mb, kl in zip(batches, kls)]
        pairs = [gae(r, v, m, gamma=a.gamma, lam=a.lambd) for r, v, m in zip(rewards, values, masks)]
        raw = [p[0] for p in pairs]
        metrics |= value_metrics(values, [p[1] for p in pairs], masks)
        flat = iter([ValueTargets(v, p[1]) for v, p in zip(values, pairs)])
        targets = [[next(flat) for _ in st] for st in steps]
    elif a.advantage_estimator == "reinforce_plus_plus":
        raw = [
            reinforce_pp_returns(mb.rewards, mb.loss_mask, kl, a.kl_coef, gamma=a.gamma, whiten=False)
            for mb, kl in zip(batches, kls)
        ]
    else:
        raise ValueError(f"{a.advantage_estimator!r} is not a token-level estimator")
    advs = whiten(raw, masks)
    for mb, adv in zip(batches, advs):
        mb.advantages.copy_(adv)
    n, s, sq = _masked_sums(advs, masks, lambda x: x, lambda x: x.square())
    lo, hi = _masked_extremes(advs, masks)
    mean = s / max(n, 1.0)
    metrics |= {"adv_mean": mean, "adv_std": math.sqrt(max(sq / max(n, 1.0) - mean**2, 0.0))}
    metrics |= {"adv_min": lo, "adv_max": hi}
    if a.kl_coef > 0:
        n, k = _masked_sums(kls, masks, lambda x: x)
        metrics["reward_kl"] = k / max(n, 1.0)
    return targets, metrics


def value_metrics(
    values: list[torch.Tensor], returns: list[torch.Tensor], masks: list[torch.Tensor]
) -> dict[str, float]:
    """Mean value and return, and explained variance 1 - Var(R - V) / Var(R), over the rollout's trained tokens
    (NaN when every return is the same: nothing to explain)."""
    diffs = [r - v for r, v in zip(returns, values)]
    n, sv = _masked_sums(values, masks, lambda x: x)
    _, sr, sr2 = _masked_sums(returns, masks, lambda x: x, lambda x: x.square())
    _, sd, sd2 = _masked_sums(diffs, masks, lambda x: x, lambda x: x.square())
    n = max(n, 1.0)
    var_r = sr2 / n - (sr / n) ** 2
    var_d = sd2 / n - (sd / n) ** 2
    explained = 1.0 - var_d / var_r if var_r > 1e-12 else float("nan")
    return {"value_mean": sv / n, "returns_mean": sr / n, "explained_var": explained}
