"""Policy-gradient losses on per-token log-probs. All tensors are [batch, tokens]; mask is 1 on trained tokens.

The objectives, each the whole loss of one micro-batch in one block (what the trainer backpropagates):
policy_objective: the policy's loss: PPO-clip, GSPO, CISPO or SAPO surrogate, TIS, KL loss, entropy bonus,
    aggregation.
value_objective: the PPO critic's clipped value loss, token mean.
sft_objective: SFT's negative log-likelihood, token mean.

Their per-token pieces:
ppo_clip_loss / ppo_clip_loss_with_stats: PPO clipped surrogate (Schulman et al. 2017), optional decoupled
    eps_low/eps_high (DAPO "clip-higher") and dual clip (Ye et al. 2020).
gspo_loss: sequence-level importance ratio (Zheng et al. 2025, "Group Sequence Policy Optimization").
cispo_loss: REINFORCE-style loss with a clipped, stop-gradient importance weight (MiniMax-M1, 2025).
sapo_loss: PPO's hard clip replaced by a sigmoid gate of the ratio (Qwen team 2025, "Soft Adaptive Policy
    Optimization", arXiv:2511.20347).
tis_weights: truncated importance sampling against the rollout engine's log-probs (training-inference mismatch).
icepop_weights / mis_weights: the mismatch ratio's token mask (IcePop) and sequence mask (geometric-mean MIS);
    mismatch_weights picks the correction (tis_mode or a user's function), mismatch_kl measures the mismatch.
value_loss: clipped value loss for a PPO critic.
sft_loss: per-token negative log-likelihood.
kl_penalty: per-token KL estimators (k1/k2/k3).
aggregate: per-token -> scalar reductions (token_mean, seq_mean_token_mean, seq_mean_token_sum_norm).
Per-token losses are returned un-masked unless a function takes `mask`; `aggregate` applies the mask.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from sluiceway.flows.config.variants import CispoLoss, GspoLoss, PpoClipLoss, SapoLoss

if TYPE_CHECKING:
    from sluiceway.flows.config import AlgorithmConfig


def ppo_clip_loss_with_stats(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    clip_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (to minimise) with optional dual clip, and per-token 0/1 indicators of each clip.

    r = exp(logp - old_logp),  L_clip = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))   (Schulman et al. 2017)
    Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"), clip_c > 1:
        L = min(L_clip, -A * clip_c)  where A < 0,   L = L_clip  where A >= 0
    i.e. for a negative advantage the loss (and its gradient) stops growing once r > clip_c.
    Indicators (float, same shape as the loss; not masked):
        clipped      -- the upper or lower clip is active (L_clip comes from the clipped term; zero gradient)
        clipped_high -- clipped with A > 0 (r > 1 + eps_high);   clipped_low -- clipped with A < 0 (r < 1 - eps_low)
        dual_clipped -- the dual clip is active (A < 0 and r > clip_c); all zero when clip_c is None
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped_term = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped_term)
    clipped = clipped_term > unclipped
    dual = torch.zeros_like(clipped)
    if clip_c is not None:
        if clip_c <= 1.0:
            raise ValueError(f"dual clip constant must be > 1, got {clip_c}")
        bound = -advantages * clip_c
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    stats = {
        "clipped": clipped.float(),
        "clipped_high": (clipped & (advantages > 0)).float(),
        "clipped_low": (clipped & (advantages < 0)).float(),
        "dual_clipped": dual.float(),
    }
    return loss, stats


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate (to minimise) and whether the (upper/lower) clip was active.

    See `ppo_clip_loss_with_stats` for the formula, the dual clip (clip_c) and its activity indicator.
    """
    loss, stats = ppo_clip_loss_with_stats(logp, old_logp, advantages, eps_low, eps_high, clip_c)
    return loss, stats["clipped"]


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages_seq: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO per-token loss (Zheng et al. 2025, "Group Sequence Policy Optimization", GSPO-token form).

    Sequence ratio (length-normalised), over the trained tokens of sequence i (|y_i| of them):
        s_i = exp( (1/|y_i|) * sum_t mask_it * (logp_it - old_logp_it) )
    Token ratio with the paper's stop-gradient trick, equal in value to s_i:
        s_it = sg[s_i] * exp(logp_it - sg[logp_it])
    Loss:  L_it = max(-A_i * s_it, -A_i * clip(s_it, 1 - eps_low, 1 + eps_high)) * mask_it
    so d L_it / d logp_it = -A_i * s_i where the clip is inactive (0 where it is active), and averaging L_it over the
    sequence's tokens (aggregate "seq_mean_token_mean") gives GSPO's gradient -A_i * s_i * (1/|y_i|) * grad logp_it.
    The clip decision is per sequence. advantages_seq: [b] (or [b, t], used per token). Returns (per-token loss,
    clipped indicator), both zeroed outside mask. sg[log s_i] is clamped to [-20, 20] (no gradient flows through it).
    """
    m = mask.to(logp.dtype)
    n = m.sum(-1).clamp(min=1.0)
    log_s = ((logp - old_logp) * m).sum(-1) / n  # [b]
    log_s = log_s.detach().clamp(-20.0, 20.0)
    log_s_tok = log_s.unsqueeze(-1) + logp - logp.detach()
    s_tok = torch.exp(log_s_tok)
    adv = advantages_seq.unsqueeze(-1) if advantages_seq.dim() == 1 else advantages_seq
    unclipped = -adv * s_tok
    clipped_term = -adv * s_tok.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped_term) * m
    return loss, (clipped_term > unclipped).to(logp.dtype) * m


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO per-token loss (MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
    2025): clip the importance-sampling weight, not the update.

        r_t   = exp(logp_t - old_logp_t)
        w_t   = sg[ clip(r_t, 1 - eps_low, 1 + eps_high) ]           (sg: stop-gradient; w_t is a constant)
        L_t   = -w_t * A_t * logp_t
    so d L_t / d logp_t = -w_t * A_t for every token: unlike PPO-clip, a token whose ratio left the trust region
    still contributes a gradient (with its weight capped), it is never dropped. At r_t = 1 the gradient equals
    PPO's, -A_t. eps_low >= 1 puts no lower bound on the weight (r_t > 0), the paper's setting (it tunes eps_high
    only). The value of L_t is a surrogate (it depends on logp_t itself), only its gradient is meaningful.
    Returns (per-token loss, indicator that the weight was clipped: r_t < 1 - eps_low or r_t > 1 + eps_high);
    neither is masked.
    """
    ratio = torch.exp(logp.detach() - old_logp.detach())
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    w = ratio.clamp(min=lo, max=hi)
    loss = -w * advantages * logp
    return loss, ((ratio < lo) | (ratio > hi)).to(logp.dtype)


def sapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    tau_pos: float,
    tau_neg: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SAPO per-token loss (Qwen team 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347): PPO's hard clip
    replaced by a smooth, temperature-controlled sigmoid gate of the ratio.

        r_t   = exp(logp_t - old_logp_t)
        tau_t = tau_pos if A_t > 0 else tau_neg                   (asymmetric; the paper takes tau_neg > tau_pos)
        f(r)  = (4 / tau_t) * sigmoid(tau_t * (r - 1))
        L_t   = -A_t * f(r_t)
    Its gradient: d L_t / d logp_t = -A_t * g_t * r_t with the soft gate g_t = 4 * s * (1 - s),
    s = sigmoid(tau_t * (r_t - 1)): g = 1 at r = 1 (on-policy, the gradient is PPO's -A_t), 0 < g <= 1, and g decays
    smoothly as r moves away from 1, faster for a larger tau (tau_neg > tau_pos damps negative-advantage tokens
    sooner). As tau -> 0, f(r) = 2/tau + (r - 1) + O(tau^2) and the gradient tends to the unclipped surrogate's
    -A_t * r_t. There is no hard clip: the returned indicator is all zeros (clipfrac 0). The paper's defaults are
    tau_pos = 1.0, tau_neg = 1.05. The log-ratio is clamped to [-20, 20] (where the gate is already 0 in float32),
    so an extreme ratio gives a zero gradient, never inf * 0. Returns (per-token loss, zeros); not masked.
    """
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    loss = -advantages * (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
    return loss, torch.zeros_like(loss)


def tis_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    clip_high: float = 2.0,
    clip_low: float | None = None,
) -> torch.Tensor:
    """Truncated importance-sampling weights for the training-inference mismatch (rollout engine vs trainer).

    w_t = clamp(exp(old_logp_t - rollout_logp_t), clip_low, clip_high), detached (no clamp below when clip_low is
    None). old_logp: the trainer's log-probs of the behaviour policy; rollout_logp: the inference engine's. Multiply the
    per-token policy loss by w before `aggregate` (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training").
    """
    if clip_low is not None and clip_low > clip_high:
        raise ValueError(f"clip_low {clip_low} > clip_high {clip_high}")
    w = torch.exp(old_logp.detach() - rollout_logp.detach())
    return w.clamp(min=clip_low, max=clip_high)


def mismatch_band(clip_high: float, clip_low: float | None) -> tuple[float, float]:
    """[low, high] of the masking corrections (icepop, mis): [clip_low, clip_high], clip_low defaulting to
    1 / clip_high, the symmetric band [1/b, b] in ratio (|log ratio| <= log b)."""
    return (1.0 / clip_high if clip_low is None else clip_low), clip_high


def icepop_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """IcePop token masking of the training-inference mismatch (Ant Group's Ling team, IcePop blog post, Sep 2025,
    ringtech.notion.site/icepop; used to train Ring-1T): a token whose trainer/engine probability ratio leaves the
    band [low, high] (the post's [alpha, beta]) is dropped from the gradient.

        k_t = exp(old_logp_t - rollout_logp_t)                          (trainer's behaviour policy / rollout engine)
        w_t = k_t  if low <= k_t <= high,  else 0
    As in slime's icepop_function, a token inside the band is also importance-weighted by k_t (TIS inside the
    band, a mask outside it), not weighted 1. Multiply the per-token policy loss by w_t before `aggregate`; the
    aggregation's denominators are unchanged, so a masked token still counts in the token mean (as in slime).
    The log-ratio is clamped to [-20, 20] first (any such ratio lies outside a sensible band). Returns (w, kept),
    w detached, kept the bool tensor low <= k_t <= high; neither is masked.
    """
    log_k = (old_logp.detach() - rollout_logp.detach()).clamp(-20.0, 20.0)
    k = torch.exp(log_k)
    kept = (k >= low) & (k <= high)
    return torch.where(kept, k, torch.zeros_like(k)), kept


def mis_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level masked importance sampling (MIS) on the geometric-mean ratio: a sequence whose trainer and
    engine disagree too much is dropped whole (the sequence-level IS and masking of Liu, Li et al. 2025, "When
    Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch"; the length-normalised
    ratio and the weight inside the band follow slime's examples/train_infer_mismatch_helper, tis_level
    geometric with tis_mode mask).

        rho_i = exp( (1/|y_i|) * sum_t mask_it * (old_logp_it - rollout_logp_it) )   (|y_i|: trained tokens of i)
        w_it  = rho_i  if low <= rho_i <= high,  else 0                              (every token of sequence i)
    rho_i is the geometric mean of the token ratios, so unlike the sequence product its scale does not grow with
    the length: the band should be narrow (slime suggests about [0.9999, 1.0001]; 1/b..b with b near 1). The mean
    log-ratio is clamped to [-20, 20]. A row without trained tokens gets rho = 1. Returns (w [b, t] detached,
    kept [b] bool); w is not masked.
    """
    m = mask.to(old_logp.dtype)
    diff = torch.where(m > 0, old_logp.detach() - rollout_logp.detach(), torch.zeros_like(m))  # no inf * 0
    log_rho = (diff.sum(-1) / m.sum(-1).clamp(min=1.0)).clamp(-20.0, 20.0)
    rho = torch.exp(log_rho)
    kept = (rho >= low) & (rho <= high)
    w = torch.where(kept, rho, torch.zeros_like(rho))
    return w.unsqueeze(-1).expand_as(old_logp), kept


def mismatch_kl(old_logp: torch.Tensor, rollout_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(rollout engine || trainer) on tokens the engine sampled (Schulman's k3):

        d_t = old_logp_t - rollout_logp_t,   kl_t = exp(d_t) - 1 - d_t   (>= 0, 0 where the two agree)
    E_rollout[exp(d) - 1 - d] = KL(pi_rollout || pi_old), as slime's k3_kl mismatch metric. d is clamped to
    [-20, 20] so one wild token cannot make the step's metric inf. Not masked.
    """
    d = (old_logp.detach() - rollout_logp.detach()).clamp(-20.0, 20.0)
    return torch.exp(d) - 1.0 - d


@functools.cache
def _custom_tis_function(path: str) -> Callable:
    from sluiceway.infra.plugins import load_function

    return load_function(path, "--custom-tis-function-path")


def mismatch_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, algorithm: AlgorithmConfig
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token weights [b, t] that use_tis multiplies the policy loss by, which tokens they bounded, and a
    custom function's metrics.

    tis_mode truncate: `tis_weights` (bounded: the ratio was clamped); icepop: `icepop_weights`, mis: `mis_weights`
    on `mismatch_band(tis_clip, tis_clip_low)` (bounded: masked out). custom_tis_function_path names
    fn(old_logp, rollout_logp, mask, algorithm) -> weights, or (weights, metrics): weights a tensor broadcastable to
    [b, t] (detached here), metrics {name: tensor broadcastable to [b, t]}, each logged as its token mean over the
    step's trained tokens as tis_<name> (the same names on every call); bounded: its zero weights.
    """
    a = algorithm
    metrics: dict[str, torch.Tensor] = {}
    if a.custom_tis_function_path:
        out = _custom_tis_function(a.custom_tis_function_path)(old_logp.detach(), rollout_logp.detach(), mask, a)
        w, metrics = out if isinstance(out, tuple) else (out, {})
        w = torch.as_tensor(w, dtype=old_logp.dtype).detach().expand_as(old_logp)
        return w, w == 0, metrics
    if a.tis_mode == "icepop":
        w, kept = icepop_weights(old_logp, rollout_logp, *mismatch_band(a.tis_clip, a.tis_clip_low))
        return w, ~kept, metrics
    if a.tis_mode == "mis":
        w, kept = mis_weights(old_logp, rollout_logp, mask, *mismatch_band(a.tis_clip, a.tis_clip_low))
        return w, ~kept.unsqueeze(-1).expand_as(w), metrics
    w = tis_weights(old_logp, rollout_logp, a.tis_clip, a.tis_clip_low)
    ratio = torch.exp(old_logp.detach() - rollout_logp.detach())
    return w, w != ratio, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss for a PPO critic (Schulman et al. 2017; as in OpenAI baselines' ppo2).

    V_clip = old_V + clamp(V - old_V, -clip, clip)
    L_t = 0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2) * mask_t        (clip=None: 0.5 * (V_t - R_t)^2 * mask_t)
    Returns (per-token loss, indicator that the clipped term was the larger one), both zeroed outside mask;
    reduce with `aggregate`.
    """
    m = mask.to(values.dtype)
    returns = returns.detach()
    err = (values - returns).square()
    if clip is None:
        return 0.5 * err * m, torch.zeros_like(m)
    old_values = old_values.detach()
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    err_clip = (v_clip - returns).square()
    return 0.5 * torch.maximum(err, err_clip) * m, (err_clip > err).to(values.dtype) * m


def sft_loss(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood, -logp_t * mask_t (reduce with `aggregate`)."""
    return -logp * mask.to(logp.dtype)


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


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    denom: float,
    num_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce per-token losses to a scalar for a micro-batch that is part of a larger global batch.

    Summing the results over the micro-batches of a global batch gives the global-batch loss. What `denom` means:
    token_mean: sum over the micro-batch's trained tokens / `denom`, `denom` = trained-token count of the global batch.
    seq_mean_token_mean: mean over each sequence's trained tokens, summed over sequences, / `denom`,
        `denom` = number of sequences in the global batch.
    seq_mean_token_sum_norm (Liu et al., "Understanding R1-Zero-Like Training", Dr. GRPO): each sequence's token SUM
        divided by a constant, `denom` = the maximum response length L_max (the same for every sequence, so short and
        long answers are weighed per token alike), then summed over sequences / `num_seqs`, the number of sequences
        in the global batch (default: this micro-batch's rows, i.e. a plain mean over its sequences).
    `num_seqs` is used by seq_mean_token_sum_norm only. Denominators below 1 are treated as 1.
    """
    if mode == "token_mean":
        return (per_token * mask).sum() / max(denom, 1.0)
    if mode == "seq_mean_token_mean":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / max(denom, 1.0)
    if mode == "seq_mean_token_sum_norm":
        per_seq = (per_token * mask).sum(-1) / max(denom, 1.0)
        n = float(per_token.shape[0]) if num_seqs is None else num_seqs
        return per_seq.sum() / max(n, 1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}")


# ---------------------------------------------------------------------------------------------------------------------
# The objectives: one micro-batch's scalar loss (to backpropagate) and its statistics
# ---------------------------------------------------------------------------------------------------------------------


def policy_objective(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    algorithm: AlgorithmConfig,
    *,
    entropy: torch.Tensor,
    rollout_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    n_tokens: float,
    n_seqs: float,
    max_response_len: float,
    as_tensors: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy's loss on one micro-batch of an optimizer step, and its share of the step's statistics.

    logp, entropy: the policy's, with gradient; old_logp: the behaviour policy's (the trainer's before the step);
    rollout_logp: the inference engine's; ref_logp: the frozen reference model's (None: no KL term). n_tokens,
    n_seqs: trained tokens and sequences of the whole optimizer step, all ranks; max_response_len: Dr. GRPO's
    constant. The micro-batches' losses sum to the step's loss, and their statistics to the step's (token means
    over the step; logprob_mismatch_max is a max).

        pg   = by policy_loss: ppo_clip: PPO-clip surrogate (dual clip with eps_clip_c), or GSPO's sequence-ratio
               surrogate when advantage_estimator is gspo; cispo: -sg[clip(r, 1 - eps_clip, 1 + eps_clip_high)] * A
               * logp; sapo: -A * (4/tau) * sigmoid(tau * (r - 1)), tau = sapo_tau_pos (A > 0) or sapo_tau_neg
        pg  *= if use_tis, by tis_mode (`mismatch_weights`): truncate: clamp(exp(old - rollout), tis_clip_low,
               tis_clip); icepop: the token ratio inside the band, 0 outside; mis: the sequence's geometric-mean
               ratio inside the band, 0 outside; or custom_tis_function_path's weights
        loss = agg(pg) + kl_loss_coef * agg(KL(policy || ref)) - entropy_coef * agg(entropy)
    Mismatch statistics (token means over the step unless said): mismatch_kl (`mismatch_kl`, k3 of rollout vs
    old), tis_weight_mean (1 without use_tis), tis_clipfrac (weights clamped or masked), tis_masked_frac (weight
    0), tis_masked_seq_frac (share of the step's sequences all of whose trained tokens have weight 0: mis's
    masked sequences), and a custom function's tis_<name>.

    The statistics are floats, or with `as_tensors` float64 0-dim tensors on the loss's device holding the same
    values: reading a float waits for the device, and the trainer reads a step's statistics once (issue 44).
    """
    a = algorithm
    # What the aggregation divides by (see `aggregate`): tokens, sequences, or Dr. GRPO's constant.
    denom = {"token_mean": n_tokens, "seq_mean_token_mean": n_seqs}.get(a.loss_agg_mode, max_response_len)
    agg_kw = {"num_seqs": n_seqs} if a.loss_agg_mode == "seq_mean_token_sum_norm" else {}

    def agg(per_token: torch.Tensor) -> torch.Tensor:
        return aggregate(per_token, mask, a.loss_agg_mode, denom, **agg_kw)

    match a.policy:  # the variant of the policy-loss family, with its own settings (flows/config/variants.py)
        case GspoLoss(eps_clip=low, eps_clip_high=high):
            pg, clipped = gspo_loss(logp, old_logp, advantages, mask, low, high)
        case CispoLoss(eps_clip=low, eps_clip_high=high):
            pg, clipped = cispo_loss(logp, old_logp, advantages, low, high)
        case SapoLoss(tau_pos=tau_pos, tau_neg=tau_neg):
            pg, clipped = sapo_loss(logp, old_logp, advantages, tau_pos, tau_neg)
        case PpoClipLoss(eps_clip=low, eps_clip_high=high, eps_clip_c=clip_c):
            pg, clipped = ppo_clip_loss(logp, old_logp, advantages, low, high, clip_c=clip_c)
    tis_metrics: dict[str, torch.Tensor] = {}
    if a.use_tis:
        weights, bounded, tis_metrics = mismatch_weights(old_logp, rollout_logp, mask, a)
        pg = pg * weights
    else:
        weights, bounded = torch.ones_like(old_logp), torch.zeros_like(mask, dtype=torch.bool)
    loss = agg(pg)
    no_kl = torch.zeros((), device=loss.device)
    stats = {"pg_loss": _share(loss, 1.0, as_tensors), "kl": _share(no_kl, 1.0, as_tensors)}
    if ref_logp is not None:
        kl = agg(kl_penalty(logp, ref_logp, a.kl_loss_type))
        loss = loss + a.kl_loss_coef * kl
        stats["kl"] = _share(kl, 1.0, as_tensors)
    ent = agg(entropy)
    if a.entropy_coef:
        loss = loss - a.entropy_coef * ent
    # Token-averaged diagnostics over the whole optimizer step.
    gap = (logp.detach() - rollout_logp).abs() * mask  # training-inference mismatch per token
    per_token = max(n_tokens, 1.0)
    stats |= {
        "loss": _share(loss, 1.0, as_tensors),
        "entropy": _share(ent, 1.0, as_tensors),
        "clipfrac": _share((clipped * mask).sum(), per_token, as_tensors),
        "ratio": _share((torch.exp(logp.detach() - old_logp) * mask).sum(), per_token, as_tensors),
        "logprob_mismatch": _share(gap.sum(), per_token, as_tensors),
        "logprob_mismatch_max": _share(gap.max(), 1.0, as_tensors),
    }
    stats |= _mismatch_stats(old_logp, rollout_logp, mask, weights, bounded, tis_metrics, n_tokens, n_seqs,
                             as_tensors)  # fmt: skip
    return loss, stats


def _share(x: torch.Tensor, denom: float, as_tensor: bool) -> float | torch.Tensor:
    """x's value / denom: a float, or a float64 0-dim tensor on x's device (the same number: float64 division of
    the same single value, as Python's float division is)."""
    return x.detach().double() / denom if as_tensor else float(x.detach()) / denom


def _mismatch_stats(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    bounded: torch.Tensor,
    extra: dict[str, torch.Tensor],
    n_tokens: float,
    n_seqs: float,
    as_tensors: bool = False,
) -> dict[str, float]:
    """This micro-batch's share of the step's mismatch statistics (see `policy_objective`)."""
    m = mask.to(old_logp.dtype)
    trained = m > 0

    def token_share(x: torch.Tensor) -> float:
        return _share((x.to(m.dtype).expand_as(m) * m).sum(), max(n_tokens, 1.0), as_tensors)

    masked = (weights == 0) & trained
    seq_masked = trained.any(-1) & (masked.sum(-1) == trained.sum(-1))
    out = {
        "mismatch_kl": token_share(mismatch_kl(old_logp, rollout_logp)),
        "tis_weight_mean": token_share(weights),
        "tis_clipfrac": token_share(bounded),
        "tis_masked_frac": token_share(masked),
        "tis_masked_seq_frac": _share(seq_masked.sum(), max(n_seqs, 1.0), as_tensors),
    }
    for name, value in extra.items():
        out[name if name.startswith("tis_") else f"tis_{name}"] = token_share(torch.as_tensor(value).detach())
    return out


def value_objective(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
    n_tokens: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The critic's loss on one micro-batch: clipped value loss, token mean over the optimizer step's n_tokens."""
    per_token, clipped = value_loss(values, old_values, returns, mask, clip)
    loss = aggregate(per_token, mask, "token_mean", n_tokens)
    return loss, {"value_loss": loss.item(), "value_clipfrac": float(clipped.sum()) / max(n_tokens, 1.0)}


def sft_objective(
    logp: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, n_tokens: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """SFT's loss on one micro-batch: negative log-likelihood, token mean over the global batch's n_tokens."""
    loss = aggregate(sft_loss(logp, mask), mask, "token_mean", n_tokens)
    return loss, {"loss": loss.item(), "entropy": aggregate(entropy.detach(), mask, "token_mean", n_tokens).item()}
