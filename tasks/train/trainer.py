"""The policy trainer: a megatron-core GPTModel built from HF weights, trained with a PPO-clip objective.

On CPU megatron's own DDP/optimizer are CUDA-only (docs/design.md), so the optimizer is torch's AdamW. With
`bf16` the model computes in bf16 while AdamW updates fp32 master copies of its weights (megatron's own
mixed-precision scheme; autocast is not an option because megatron's linear layers pin autocast to CUDA).
Weights leave the trainer in HF names, from the fp32 masters. With `use_distributed_optimizer` each data-parallel
rank keeps only its shard of the masters and of AdamW's moments (ZeRO-1, zero.py).

The trainer holds the models, optimizer and parallel layout and runs the steps; what a step uses lives beside it:
the samples (`TrainSample`) in samples.py, their micro-batches in collation.py, the objectives in losses.py, the
LR schedule in lr_schedule.py, the checkpoint directory format in checkpoint.py, the critic in critic.py. What
trains of the model (every weight, or adapters on a frozen base) is a transform it composes (model_transform.py);
the memory this all takes is planned in memory_plan.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
from sluiceway.models.hf_megatron import load_hf_weights
from sluiceway.models.megatron_gpt import (
    allreduce_gradients,
    build_gpt_model,
    init_parallel_state,
    parallel_state,
    recompute_overrides,
)
from sluiceway.models.megatron_logprobs import logprobs_at
from sluiceway.models.zoo import load_hf_state_dict
from sluiceway.tasks.sync.disk import write_weight_version
from sluiceway.tasks.train.advantages import TOKEN_LEVEL_ESTIMATORS, token_advantages
from sluiceway.tasks.train.checkpoint import load_checkpoint, save_checkpoint
from sluiceway.tasks.train.collation import MicroBatch, OptimizerStep, collate, plan_optimizer_steps
from sluiceway.tasks.train.critic import Critic, needs_reference
from sluiceway.tasks.train.losses import policy_objective, sft_objective
from sluiceway.tasks.train.lr_schedule import lr_schedule
from sluiceway.tasks.train.micro_batches import plan_micro_batches, shard_for_rank
from sluiceway.tasks.train.model_transform import model_transform
from sluiceway.tasks.train.opd import DistillationTerm
from sluiceway.tasks.train.optim import adamw, step_master_weights
from sluiceway.tasks.train.parallel import is_tensor_parallel, reduce_step_metric_tensors, reduce_step_metrics
from sluiceway.tasks.train.samples import NonFiniteTraining, TrainSample, check_samples
from sluiceway.tasks.train.weight_rounding import MasterRounding
from sluiceway.tasks.train.zero import ShardedAdamW, state_bytes

log = logging.getLogger("sluiceway")


def non_finite_samples(mb: MicroBatch, tensors: dict[str, torch.Tensor | None]) -> list[str]:
    """Of a micro-batch whose loss is not finite, each sample with a NaN or inf among its per-token `tensors`
    ([n, w-1] each; the first such tensor named), as "(group G, sample I): its NAME is V"."""
    found: dict[int, str] = {}
    for name, t in tensors.items():
        if t is None:
            continue
        bad = ~torch.isfinite(t.detach())
        for i in bad.any(dim=1).nonzero().flatten().tolist():
            if i not in found:
                who = (mb.names[i] if mb.names else "") or f" (row {i} of a micro-batch)"
                found[i] = f"{who.strip()}: its {name} is {float(t.detach()[i][bad[i]][0])!r}"
    return [found[i] for i in sorted(found)]


def blame(bad: list[str], n_samples: int) -> str:
    """What the error says of the samples: the one to blame, or that every sample (the model) is."""
    if not bad:
        return ""
    if len(bad) == n_samples and n_samples > 1:
        return f" in every sample, e.g. {bad[0]}"
    return f" from sample {bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")


class PolicyTrainer:
    def __init__(
        self,
        hf_dir: str | Path,
        training: TrainingConfig,
        algorithm: AlgorithmConfig,
        temperature: float,
        pad_token_id: int,
        device: torch.device | str = "cpu",
        total_iters: int | None = None,
        max_response_len: int | None = None,
        tensor_parallel: int = 1,
    ):
        self.training, self.algorithm, self.temperature = training, algorithm, temperature
        self.pad_token_id = pad_token_id
        self.device = torch.device(device)
        self.total_iters = total_iters  # optimizer steps in the whole run, for LR decay
        self.max_response_len = max_response_len  # Dr. GRPO's constant normaliser
        self.hf_config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
        # Under torchrun this joins the process group (DP = world / TP); alone it is a world of one.
        init_parallel_state(tensor_model_parallel_size=tensor_parallel)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        torch.manual_seed(training.seed)
        dtype = torch.bfloat16 if training.bf16 else torch.float32
        # Activation recompute trades compute for memory in training only (the reference model has no backward).
        recompute = recompute_overrides(training)
        self.model = build_gpt_model(self.hf_config, dtype=dtype, device=self.device, **recompute)
        if recompute:
            log.info("activation recompute: %s", ", ".join(f"{k} {v}" for k, v in sorted(recompute.items())))
        hf_state = load_hf_state_dict(hf_dir)
        load_hf_weights(self.model, hf_state, self.hf_config)
        # What trains of the model (tasks/train/model_transform.py): every weight, or adapters on a frozen base.
        # `trainable` is what the optimizer, gradient all-reduce and checkpoints see.
        self.transform = model_transform(self.model, self.hf_config, training, self.tp_rank, self.tp_size, self.device)
        self.trainable = self.transform.trainable
        self.mixed_precision = self.transform.separate_masters
        self.param_names = [n for n, _ in self.trainable.named_parameters()]
        params = [p for _, p in self.trainable.named_parameters()]
        self.rounding = None  # how the bf16 model takes its masters' values (tasks/train/weight_rounding.py)
        if self.mixed_precision:
            self.master = self.transform.fp32_masters(hf_state, self.param_names)
            if training.bf16_weight_rounding == "stochastic":
                # The masters start on the bf16 grid, at the weights the engines load from the checkpoint (rounded
                # to nearest): the first rollout's engine and this trainer then compute with the same weights.
                self.master = [m.to(torch.bfloat16).float() for m in self.master]
            numels = [p.numel() for p in params]
            self.rounding = MasterRounding(training.bf16_weight_rounding, numels, training.seed, self.tp_rank,
                                           self.device)  # fmt: skip
            self.rounding.copy(params, self.master)
        else:
            self.master = params  # fp32: the trained parameters are the master weights
        # The frozen reference: (the model that computes it, the context it computes in), or None without one.
        self.ref_model, self._reference = None, None
        if needs_reference(algorithm):
            base = self.transform.frozen_base()
            if base is not None:  # the policy model with its transform switched off
                self._reference = (self.model, base)
            else:  # a second model, not a deepcopy: megatron modules hold process groups, which do not copy
                self.ref_model = build_gpt_model(self.hf_config, dtype=dtype, device=self.device)
                load_hf_weights(self.ref_model, hf_state, self.hf_config)
                self.ref_model.eval().requires_grad_(False)
                self._reference = (self.ref_model, contextlib.nullcontext)
        # --use-opd: its advantage term, and with opd_type megatron the frozen teacher it owns (tasks/train/opd.py).
        self.opd = None
        if algorithm.opd is not None:
            teacher_logprobs = lambda model, mb: self._logprobs(model, mb, temperature=1.0)[0]  # noqa: E731
            self.opd = DistillationTerm(algorithm.opd, self.hf_config, dtype, self.device, teacher_logprobs)
        # --use-distributed-optimizer: this DP rank keeps a shard of the masters and moments (tasks/train/zero.py).
        self.zero = None
        if training.use_distributed_optimizer:
            self.zero = ShardedAdamW(self.trainable, self.master if self.mixed_precision else None, training)
            self.zero.rounding = self.rounding
            self.master, self.optimizer = None, self.zero.optimizer
        else:
            self.optimizer = adamw(self.master, training)
        self.lr_factor = lr_schedule(training, total_iters)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_factor)
        self.tp_flags = [is_tensor_parallel(p) for p in params]
        self.weight_version = 0
        # PPO's value model: a GPTModel of its own from the same weights, with a scalar head and its own AdamW.
        self.critic = None
        if algorithm.advantage_estimator == "ppo":
            self.critic = Critic(self.hf_config, hf_state, training, algorithm, self.device, self.lr_factor)

    def _logprobs(self, model, mb: MicroBatch, temperature: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token (log-prob, entropy) in the micro-batch's per-sample layout [n, w-1], where the loss mask is set
        (zeros elsewhere: no loss reads a log-prob there, so the output layer skips those positions)."""
        temperature = self.temperature if temperature is None else temperature
        if mb.loss_rows is not None:  # found on the host by collate: no `nonzero` waiting for the device
            sample, t = mb.loss_rows, mb.loss_cols
        else:
            sample, t = (mb.loss_mask > 0).nonzero(as_tuple=True)
        if mb.unpack is None:  # one sample a row: position t of row `sample` predicts the token at t + 1
            rows, positions, targets = sample, t, mb.input_ids[sample, t + 1]
        else:
            flat = mb.unpack[sample, t]
            width = mb.input_ids.size(1)
            rows, positions, targets = flat // width, flat % width, mb.targets[sample, t]
        logp, ent = logprobs_at(model, mb.input_ids, rows, positions, targets, temperature, mb.attention_mask,
                                mb.position_ids)  # fmt: skip
        zeros = torch.zeros(mb.loss_mask.shape, dtype=logp.dtype, device=logp.device)
        return zeros.index_put((sample, t), logp), zeros.index_put((sample, t), ent)

    def _plan(self, samples: list[TrainSample], step: int) -> list[OptimizerStep]:
        """The step's micro-batches, collated on the host and then moved: to a GPU through pinned memory, so the
        copies never wait for the device (a copy from pageable memory waits for the work queued before it)."""
        host = torch.device("cpu")
        steps = plan_optimizer_steps(samples, step, self.training, self.pad_token_id, self.dp_size, self.dp_rank,
                                     host)  # fmt: skip
        if self.device != host:
            for st in steps:
                st.batches = [mb.to(self.device, non_blocking=True) for mb in st.batches]
        return steps

    def train_rollout(self, samples: list[TrainSample], step: int) -> dict[str, float]:
        """num_steps_per_rollout optimizer steps over one rollout's samples; returns averaged metrics.

        Filters can leave fewer samples than the global batch: the micro-batches are then shared out over
        as many optimizer steps as there are micro-batches (at most num_steps_per_rollout). With no sample
        left, nothing is trained and the weight version stays.
        """
        if not samples:
            return {"skipped": 1.0}
        check_samples(samples, step)  # a NaN or inf input is refused here, naming its sample
        t0 = time.perf_counter()
        adv = torch.tensor([s_.advantage for s_ in samples])
        steps = self._plan(samples, step)
        # With one optimizer step per rollout the policy is unchanged until the step, so the old log-probs
        # are the current ones, detached (ratio = 1 exactly). Otherwise compute them once, up front.
        old_logps: list[list[torch.Tensor] | None] = [None] * len(steps)
        if self.training.num_steps_per_rollout > 1:
            with torch.no_grad():
                old_logps = [[self._logprobs(self.model, mb)[0] for mb in st.batches] for st in steps]
        targets, token_metrics = [None] * len(steps), {}
        if self.algorithm.advantage_estimator in TOKEN_LEVEL_ESTIMATORS:
            # Per-token advantages replace the broadcast ones in the micro-batches; ppo's critic gets its targets.
            policy = lambda mb: self._logprobs(self.model, mb)[0]  # noqa: E731
            ref = (lambda mb: self._ref_logprobs(mb)) if self._has_reference() else None
            batches = [st.batches for st in steps]
            targets, token_metrics = token_advantages(batches, self.algorithm, policy, ref, self.critic, old_logps)
        train_policy = self.critic is None or not self.critic.warming_up
        metrics: dict[str, list[float]] = {}
        for st, old, tg in zip(steps, old_logps, targets or [None] * len(steps)):
            idle = {"tokens": st.n_tokens, "logprob_mismatch_max": 0.0}  # the critic warms up alone
            m = self._optimizer_step(st, old, step) if train_policy else idle
            if self.critic is not None:
                m |= self.critic.train_step(st.batches, tg, st.n_tokens, step)
            for k, v in m.items():
                metrics.setdefault(k, []).append(v)
        if self.critic is not None:
            self.critic.rollouts_trained += 1
        self.weight_version += 1
        out = {k: sum(v) / len(v) for k, v in metrics.items() if k != "logprob_mismatch_max"}
        out["logprob_mismatch_max"] = max(metrics["logprob_mismatch_max"])
        out["tokens_per_s"] = sum(metrics["tokens"]) / (time.perf_counter() - t0)
        out |= {
            "adv_mean": float(adv.mean()),
            "adv_std": float(adv.std(unbiased=False)),
            "adv_min": float(adv.min()),
            "adv_max": float(adv.max()),
        }
        return out | token_metrics

    def _accumulate(self, st: OptimizerStep, old_logps: list[torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Forward and backward over this rank's micro-batches of one optimizer step; grads accumulate.

        Nothing here waits for the device (tests/gpu/test_sync_free_step.py): the metrics stay on it, as 0-dim
        float64 tensors (the values Python floats held before: float64 sums of the same float32 numbers), and
        each micro-batch's loss is kept (`self._losses`) for the check that the step reads them in.
        """
        self.model.train()
        self.trainable.train()
        keys = ("loss", "pg_loss", "kl", "entropy", "clipfrac", "ratio", "logprob_mismatch", "logprob_mismatch_max",
                "mismatch_kl", "tis_weight_mean", "tis_clipfrac", "tis_masked_frac", "tis_masked_seq_frac")  # fmt: skip
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        sums = dict.fromkeys(keys, zero)
        self._losses: list[torch.Tensor] = []
        for i, mb in enumerate(st.batches):
            logp, entropy, old, ref_logp, advantages, kl = self._policy_inputs(mb, i, old_logps)
            if kl is not None:
                sums["opd/reverse_kl"] = sums.get("opd/reverse_kl", zero) + kl.sum().double() / st.n_tokens
            loss, stats = policy_objective(
                logp, old, advantages, mb.loss_mask, self.algorithm, entropy=entropy, rollout_logp=mb.rollout_logprobs,
                ref_logp=ref_logp, n_tokens=st.n_tokens, n_seqs=st.n_seqs,
                max_response_len=float(self.max_response_len or st.longest), as_tensors=True,
            )  # fmt: skip
            loss.backward()
            self._losses.append(stats["loss"])
            for k, v in stats.items():  # + tis_<name>
                sums[k] = torch.maximum(sums[k], v) if k == "logprob_mismatch_max" else sums.get(k, zero) + v
        # Each DP rank holds shares of global sums; TP ranks of one DP rank computed the same values.
        return reduce_step_metric_tensors(sums, max_keys=("logprob_mismatch_max",))

    def _policy_inputs(self, mb: MicroBatch, i: int, old_logps: list[torch.Tensor] | None):
        """(log-prob, entropy, old log-prob, reference log-prob or None, advantages, OPD's KL or None) of
        micro-batch `i`: what its policy loss reads."""
        logp, entropy = self._logprobs(self.model, mb)
        old = old_logps[i] if old_logps is not None else logp.detach()
        ref_logp = self._ref_logprobs(mb) if self._has_reference() else None
        advantages, kl = mb.advantages, None
        if self.opd is not None:  # A - opd_kl_coef x (student - teacher log-prob): tasks/train/opd.py
            advantages, kl = self.opd.shift(mb, old)
        return logp, entropy, old, ref_logp, advantages, kl

    @torch.no_grad()
    def _blame_non_finite(self, st: OptimizerStep, old_logps: list[torch.Tensor] | None, which: list[int]) -> str:
        """Of a step whose loss is NaN or inf, the samples to blame: the micro-batches `which` whose loss was not
        finite run again (the weights are as they were; no dropout) and their per-token numbers are searched."""
        bad: list[str] = []
        for i in which:
            mb = st.batches[i]
            logp, entropy, old, ref_logp, advantages, _ = self._policy_inputs(mb, i, old_logps)
            bad += non_finite_samples(mb, {"policy log-prob": logp, "entropy": entropy, "old log-prob": old,
                                           "reference log-prob": ref_logp, "advantage": advantages})  # fmt: skip
        return blame(bad, sum(mb.advantages.size(0) for mb in st.batches))

    def _has_reference(self) -> bool:
        return self._reference is not None

    @torch.no_grad()
    def _ref_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """The frozen reference's log-probs: its own model, or the policy model with the transform switched off."""
        model, context = self._reference
        with context():
            return self._logprobs(model, mb)[0]

    def _optimizer_step(self, st: OptimizerStep, old_logps: list[torch.Tensor] | None, step: int) -> dict[str, float]:
        sums = self._accumulate(st, old_logps)
        lr = self.optimizer.param_groups[0]["lr"]
        allreduce_gradients(self.trainable)
        metrics: dict[str, float] = {}

        def check(norm: torch.Tensor) -> None:
            """Before anything is stepped: the step's one wait for the device, its metrics, each micro-batch's
            loss and the gradient norm read in one copy; then a NaN or inf loss or norm is refused."""
            keys = list(sums)
            values = torch.stack([sums[k] for k in keys] + [norm.double().to(self.device)] + self._losses).tolist()
            metrics.update(zip(keys, values))
            metrics["grad_norm"] = values[len(keys)]
            # The loss is reduced over every rank, so all of them refuse together (no collective is left waiting).
            if not math.isfinite(metrics["loss"]):
                which = [i for i, v in enumerate(values[len(keys) + 1 :]) if not math.isfinite(v)]
                self._refuse_non_finite("loss", metrics["loss"], step, self._blame_non_finite(st, old_logps, which))
            self._refuse_non_finite("gradient norm", metrics["grad_norm"], step)

        self._step_master_weights(step, check)
        return metrics | {"lr": lr, "tokens": st.n_tokens}

    def _refuse_non_finite(self, what: str, value: float, step: int, culprit: str = "") -> None:
        """Stop before the optimizer step when `value` (the step's loss or gradient norm) is NaN or inf: the
        gradients are dropped, the weights and optimizer are as before the step, and the one-line error names
        the step and, where one sample's numbers are to blame, that sample."""
        value = float(value)
        if math.isfinite(value):
            return
        self.trainable.zero_grad(set_to_none=True)
        raise NonFiniteTraining(
            f"train: non-finite {what} {value!r} at step {step} (weight version {self.weight_version}){culprit}; "
            f"refused before the optimizer step, so no NaN reaches the weights. Fix its cause, then `sluiceway "
            f"resume` trains the step again"
        )

    def gradients(self, samples: list[TrainSample], step: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """Metrics and whole gradients of what trains (HF names; adapters in peft's) of the first optimizer step
        of `samples`, without stepping.

        A diagnostic: what the step would do, the same on every layout of ranks (the TP/DP parity tests use it).
        """
        st = self._plan(samples, step)[0]
        sums = self._accumulate(st, None)
        allreduce_gradients(self.trainable)
        return {k: float(v) for k, v in sums.items()}, self.transform.gradients()

    def _step_master_weights(self, step: int, check=None) -> torch.Tensor:
        """Clip, step AdamW and the schedule; `check(norm)` first (default: refuse a NaN or inf norm)."""
        t = self.training
        if check is None:
            check = lambda norm: self._refuse_non_finite("gradient norm", norm, step)  # noqa: E731
        if self.zero is not None:
            return self.zero.step(self.scheduler, self.tp_flags, t.clip_grad, check)
        return step_master_weights(
            self.trainable,
            self.master,
            self.optimizer,
            self.scheduler,
            self.tp_flags,
            t.clip_grad,
            self.mixed_precision,
            check,
            self.rounding,
        )

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's trained state with fp32 master values for every parameter (a collective over DP with the
        distributed optimizer and bf16: the master shards are gathered): the model in megatron names, or the
        adapters alone (the base never changes)."""
        state = self.transform.trained_state()
        masters = self.master if self.zero is None else self.zero.full_masters()
        state.update({n: m.detach() for n, m in zip(self.param_names, masters)})
        return state

    def hf_state_dict(self, include_tied_lm_head: bool = True) -> dict[str, torch.Tensor]:
        """The whole model in HF names, adapters merged in (TP shards gathered; a collective: every rank must call
        it)."""
        return self.transform.hf_state_dict(self.master_state_dict, include_tied_lm_head)

    def _model_weights_fp32(self) -> dict[str, torch.Tensor]:
        """This rank's trained state as the model holds it (bf16 values, exactly upcast to fp32 for the gathers)."""
        return {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in self.transform.trained_state().items()}  # fmt: skip

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole adapter in peft's keys (TP shards gathered; a collective)."""
        return self.transform.adapter_state_dict()

    def state(self) -> dict[str, int]:
        return {"weight_version": self.weight_version, "optimizer_state_bytes": self.optimizer_state_bytes()}

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (policy and critic): Adam's moments, and the fp32 masters where they
        are separate from the model's weights (bf16 compute). Sharded over DP with the distributed optimizer."""
        models = [self] + ([self.critic] if self.critic is not None else [])
        return sum(
            m.zero.state_bytes() if m.zero is not None
            else state_bytes(m.optimizer, m.master if m.mixed_precision else [])
            for m in models
        )  # fmt: skip

    def write_weights(
        self, hf_dir: str | Path, root: str | Path, dtype: str | None = None, adapter_only: bool = False
    ) -> Path | None:
        """Publish the current weights as an HF model directory under `root` (see tasks/sync/disk.py).

        `dtype` ("bfloat16", ...): write the masters rounded to it, as engines serving that dtype would round
        them on load (the same bits in half the bytes for bf16); None keeps fp32. A collective (the TP shards
        are gathered); rank 0 writes and returns the path, other ranks return None.
        """
        if adapter_only:  # peft's adapter directory, fp32 (engines merge it into their base)
            adapter = self.adapter_state_dict()
            if torch.distributed.get_rank() != 0:
                return None
            return self.transform.write_adapter(adapter, Path(hf_dir), Path(root), self.weight_version)
        if dtype == "bfloat16" and self.mixed_precision:
            # The engines get the bf16 weights this trainer computes with, bit for bit, however the masters were
            # rounded into them (tasks/train/weight_rounding.py): rounding the masters again could differ.
            state = self.transform.hf_state_dict(self._model_weights_fp32, include_tied_lm_head=False)
        else:
            state = self.hf_state_dict(include_tied_lm_head=False)
        if torch.distributed.get_rank() != 0:
            return None
        return write_weight_version(state, Path(hf_dir), Path(root), self.weight_version, dtype=dtype)

    def save(self, path: str | Path, step: int) -> None:
        """Write a checkpoint directory (a collective; see tasks/train/checkpoint.py)."""
        save_checkpoint(self, path, step)

    def load(self, path: str | Path) -> int:
        """Restore a checkpoint written by `save` with the same tensor-parallel size; returns its step."""
        return load_checkpoint(self, path)

    def train_sft(self, samples: list[TrainSample], step: int) -> dict[str, float]:
        """One SFT optimizer step over a global batch: NLL of the trained tokens, token-mean over the whole batch.

        Micro-batches (or packed rows, with max_tokens_per_gpu) accumulate gradients, each divided by the global
        batch's trained-token count, so their sum is one token mean however the batch is split. Log-probs are at
        temperature 1 whatever the trainer's sampling temperature. The samples come in the caller's order.
        """
        t0 = time.perf_counter()
        lengths = [len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples]
        plans = plan_micro_batches(lengths, self.training.micro_batch_size, self.training.max_tokens_per_gpu)
        mine = shard_for_rank(plans, self.dp_size, self.dp_rank)
        n_tokens = float(sum(sum(s.loss_mask) for s in samples))
        self.model.train()
        self.trainable.train()
        sums = {"loss": 0.0, "entropy": 0.0}
        for p in mine:
            mb = collate([samples[i] for i in p.samples], self.pad_token_id, p.rows).to(self.device)
            logp, entropy = self._logprobs(self.model, mb, temperature=1.0)
            loss, stats = sft_objective(logp, entropy, mb.loss_mask, n_tokens)
            loss.backward()
            sums["loss"] += stats["loss"]
            sums["entropy"] += stats["entropy"]
        sums = reduce_step_metrics(sums)
        self._refuse_non_finite("SFT loss", sums["loss"], step)
        sums["lr"] = self.optimizer.param_groups[0]["lr"]
        allreduce_gradients(self.trainable)
        sums["grad_norm"] = float(self._step_master_weights(step))
        self.weight_version += 1
        sums["tokens"] = n_tokens
        sums["tokens_per_s"] = n_tokens / (time.perf_counter() - t0)
        return sums
