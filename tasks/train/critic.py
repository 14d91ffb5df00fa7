"""Token-level advantages for the trainer: PPO with a critic (GAE) and REINFORCE++ (KL-shaped returns).

The trainer plans its micro-batches first, then `token_advantages` overwrites each micro-batch's broadcast
advantages with per-token ones; the PPO-clip loss (dual clip, TIS, KL loss, entropy, aggregation) then runs on them
unchanged. Per-token rewards are the sample's reward on its last trained token minus `kl_coef` x KL(policy ||
reference) on every trained token (slime's reward-side KL; the policy log-probs are the trainer's, before the
step). Whitening is over every trained token of the rollout, all data-parallel ranks together (sums all-reduced),
so a micro-batch's advantages do not depend on how the batch was split.

`Critic` is the value model: the policy's GPTModel with a scalar head (models/value_model.py), fp32 master weights
and an AdamW of its own, trained after each policy optimizer step on the same micro-batches with the clipped
value loss against the GAE returns.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
from sluiceway.models.hf_megatron import hf_to_megatron
from sluiceway.models.megatron_gpt import allreduce_gradients, recompute_overrides
from sluiceway.models.value_model import build_value_model, init_value_head, token_values
from sluiceway.tasks.train.advantages import (
    TOKEN_LEVEL_ESTIMATORS,
    gae,
    reinforce_pp_returns,
    terminal_rewards,
    whitening_scale,
)
from sluiceway.tasks.train.batch import NonFiniteTraining
from sluiceway.tasks.train.losses import kl_penalty, value_objective
from sluiceway.tasks.train.optim import adamw, step_master_weights
from sluiceway.tasks.train.parallel import is_tensor_parallel, reduce_step_metrics
from sluiceway.tasks.train.zero import ShardedAdamW, restore_optimizer

if TYPE_CHECKING:
    from sluiceway.tasks.train.collation import MicroBatch

LogProbFn = Callable[["MicroBatch"], torch.Tensor]


def needs_reference(a: AlgorithmConfig) -> bool:
    """A frozen reference model is needed for the KL loss, or for the reward-side KL of the token-level estimators."""
    return a.use_kl_loss or (a.advantage_estimator in TOKEN_LEVEL_ESTIMATORS and a.kl_coef > 0)


# ---------------------------------------------------------------------------------------------------------------------
# Sums over the data-parallel group (a no-op on one rank)
# ---------------------------------------------------------------------------------------------------------------------


def _dp_reduce(t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    if parallel_state.get_data_parallel_world_size() > 1:
        dist.all_reduce(t, op=op, group=parallel_state.get_data_parallel_group())
    return t


def _masked_sums(xs: list[torch.Tensor], masks: list[torch.Tensor], *fns: Callable) -> list[float]:
    """[count, sum fn_1(x), sum fn_2(x), ...] over the masked tokens of every tensor, all DP ranks, float64."""
    rows = [torch.stack([m.double().sum()] + [(f(x).double() * m).sum() for f in fns]) for x, m in zip(xs, masks)]
    return _dp_reduce(torch.stack(rows).sum(0) if rows else torch.zeros(len(fns) + 1, dtype=torch.float64)).tolist()


def whiten(xs: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """`advantages.masked_whiten` over several tensors (and DP ranks) at once: one mean and variance."""
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
# Advantages
# ---------------------------------------------------------------------------------------------------------------------


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
    critic: Critic | None,
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


# ---------------------------------------------------------------------------------------------------------------------
# The critic
# ---------------------------------------------------------------------------------------------------------------------


class Critic:
    """The value model, its fp32 master weights, AdamW and LR schedule (the policy's schedule, at critic_lr)."""

    def __init__(
        self,
        hf_config: Any,
        hf_state: dict[str, torch.Tensor],
        training: TrainingConfig,
        algorithm: AlgorithmConfig,
        device: torch.device,
        lr_lambda: Callable[[int], float],
    ):
        self.training, self.algorithm = training, algorithm
        dtype = torch.bfloat16 if training.bf16 else torch.float32
        head = init_value_head(hf_config.hidden_size, training.seed)
        overrides = recompute_overrides(training)
        self.model = build_value_model(hf_config, hf_state, head, dtype=dtype, device=device, **overrides)
        self.param_names = [n for n, _ in self.model.named_parameters()]
        params = [p for _, p in self.model.named_parameters()]
        self.mixed_precision = training.bf16
        if self.mixed_precision:
            # As the policy: masters from the fp32 weights, not from their bf16 rounding.
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            tp_size = parallel_state.get_tensor_model_parallel_world_size()
            full = hf_to_megatron(hf_state, hf_config, tp_rank=tp_rank, tp_size=tp_size)
            full["output_layer.weight"] = head  # the head, not an untied model's LM head
            self.master = [full[n].detach().float().to(device).clone() for n in self.param_names]
        else:
            self.master = params
        self.tp_flags = [is_tensor_parallel(p) for p in params]
        lr = algorithm.critic_lr if algorithm.critic_lr is not None else training.lr
        self.zero = None  # --use-distributed-optimizer: as the policy's (tasks/train/zero.py)
        if training.use_distributed_optimizer:
            self.zero = ShardedAdamW(self.model, self.master if self.mixed_precision else None, training, lr)
            self.master, self.optimizer = None, self.zero.optimizer
        else:
            self.optimizer = adamw(self.master, training, lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda)
        self.rollouts_trained = 0  # for the critic-only warm-up (num_critic_only_steps)

    @property
    def warming_up(self) -> bool:
        """Whether this rollout trains the critic alone (the first num_critic_only_steps rollouts)."""
        return self.rollouts_trained < self.algorithm.num_critic_only_steps

    def values(self, mb: MicroBatch) -> torch.Tensor:
        """Per-token values in the micro-batch's per-sample layout [n, w-1], fp32 (differentiable)."""
        return mb.per_sample(token_values(self.model, mb.input_ids, mb.attention_mask, mb.position_ids))

    def train_step(
        self, batches: list[MicroBatch], targets: list[ValueTargets], n_tokens: float, step: int | None = None
    ) -> dict[str, float]:
        """One optimizer step of the clipped value loss (token mean over the step's trained tokens, all ranks);
        a NaN or inf loss or gradient norm is refused before it (`NonFiniteTraining`, naming rollout `step`)."""
        self.model.train()
        sums = {"value_loss": 0.0, "value_clipfrac": 0.0}
        for mb, tg in zip(batches, targets):
            clip = self.algorithm.value_clip
            loss, stats = value_objective(self.values(mb), tg.old_values, tg.returns, mb.loss_mask, clip, n_tokens)
            loss.backward()
            for k, v in stats.items():
                sums[k] += v
        sums = reduce_step_metrics(sums)
        self._refuse_non_finite("value loss", sums["value_loss"], step)  # reduced: every rank refuses together
        sums["critic_lr"] = self.optimizer.param_groups[0]["lr"]
        sums["critic_grad_norm"] = float(self.step(step))
        return sums

    def _refuse_non_finite(self, what: str, value: float, step: int | None) -> None:
        value = float(value)
        if math.isfinite(value):
            return
        self.model.zero_grad(set_to_none=True)
        at = "" if step is None else f" at step {step}"
        raise NonFiniteTraining(
            f"train: non-finite critic {what} {value!r}{at}; refused before the optimizer step, so no NaN reaches "
            f"the weights. Fix its cause, then `sluiceway resume` trains the step again"
        )

    def step(self, rollout_step: int | None = None) -> torch.Tensor:
        """Reduce gradients over DP, clip (TP-aware norm), AdamW on the masters, copy back; returns the grad norm."""
        allreduce_gradients(self.model)
        check = lambda norm: self._refuse_non_finite("gradient norm", norm, rollout_step)  # noqa: E731
        if self.zero is not None:
            return self.zero.step(self.scheduler, self.tp_flags, self.training.clip_grad, check)
        return step_master_weights(
            self.model,
            self.master,
            self.optimizer,
            self.scheduler,
            self.tp_flags,
            self.training.clip_grad,
            self.mixed_precision,
            check,
        )

    def state_dict(self) -> dict[str, Any]:
        """A collective over DP with the distributed optimizer (the shards are gathered; complete on DP rank 0)."""
        masters = self.master if self.zero is None else self.zero.full_masters()
        return {
            "model": {n: m.detach() for n, m in zip(self.param_names, masters)},
            "optimizer": self.optimizer.state_dict() if self.zero is None else self.zero.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rollouts_trained": self.rollouts_trained,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        values = [state["model"][n] for n in self.param_names]
        with torch.no_grad():
            for p, v in zip(self.model.parameters(), values):
                p.copy_(v)
        restore_optimizer(self, values, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.rollouts_trained = state["rollouts_trained"]
