"""The PPO critic: the value model the `ppo` estimator's GAE (tasks/train/advantages.py: `token_advantages`) reads.

`Critic` is the policy's GPTModel with a scalar head (models/value_model.py), fp32 master weights and an AdamW of
its own, trained after each policy optimizer step on the same micro-batches with the clipped value loss against
the GAE returns (`ValueTargets`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
from sluiceway.models.hf_megatron import hf_to_megatron
from sluiceway.models.megatron_gpt import allreduce_gradients, parallel_state, recompute_overrides
from sluiceway.models.value_model import build_value_model, init_value_head, token_values
from sluiceway.tasks.train.advantages import TOKEN_LEVEL_ESTIMATORS, ValueTargets
from sluiceway.tasks.train.losses import value_objective
from sluiceway.tasks.train.optim import adamw, step_master_weights
from sluiceway.tasks.train.parallel import is_tensor_parallel, reduce_step_metrics
from sluiceway.tasks.train.samples import NonFiniteTraining
from sluiceway.tasks.train.zero import ShardedAdamW, restore_optimizer

if TYPE_CHECKING:
    from sluiceway.tasks.train.collation import MicroBatch


def needs_reference(a: AlgorithmConfig) -> bool:
    """A frozen reference model is needed for the KL loss, or for the reward-side KL of the token-level estimators."""
    return a.use_kl_loss or (a.advantage_estimator in TOKEN_LEVEL_ESTIMATORS and a.kl_coef > 0)


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
