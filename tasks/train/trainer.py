"""The policy trainer: a megatron-core GPTModel built from HF weights, trained with a PPO-clip objective.

On CPU megatron's own DDP/optimizer are CUDA-only (DESIGN.md), so the optimizer is torch's AdamW. With
`bf16` the model computes in bf16 while AdamW updates fp32 master copies of its weights (megatron's own
mixed-precision scheme; autocast is not an option because megatron's linear layers pin autocast to CUDA).
Weights leave the trainer in HF names, from the fp32 masters.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
from sluiceway.models.hf_megatron import hf_to_megatron, load_hf_weights, megatron_state_dict, megatron_to_hf
from sluiceway.models.megatron_gpt import build_gpt_model, init_parallel_state, token_logprobs_and_entropy
from sluiceway.models.zoo import load_hf_state_dict
from sluiceway.tasks.train.losses import aggregate, gspo_loss, kl_penalty, ppo_clip_loss, tis_weights


@dataclass
class TrainSample:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]  # per response token
    advantage: float
    rollout_logprobs: list[float]  # per response token, from the engine


@dataclass
class _MicroBatch:
    input_ids: torch.Tensor  # [b, s] right-padded
    mask: torch.Tensor  # [b, s-1] 1 where the token at t+1 is a trained response token
    advantages: torch.Tensor  # [b, s-1]
    rollout_logp: torch.Tensor  # [b, s-1]

    def to(self, device: torch.device) -> _MicroBatch:
        return _MicroBatch(*(t.to(device) for t in (self.input_ids, self.mask, self.advantages, self.rollout_logp)))


def collate(samples: list[TrainSample], pad_id: int) -> _MicroBatch:
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    b = len(samples)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width - 1))
    adv = torch.zeros((b, width - 1))
    rlp = torch.zeros((b, width - 1))
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        ids[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        # logprob index t predicts token t+1: response token j sits at position p+j, predicted at p+j-1.
        mask[i, p - 1 : p - 1 + r] = torch.tensor(s.loss_mask, dtype=torch.float32)
        adv[i, p - 1 : p - 1 + r] = s.advantage
        rlp[i, p - 1 : p - 1 + r] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    return _MicroBatch(ids, mask, adv, rlp)


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
    ):
        self.training, self.algorithm, self.temperature = training, algorithm, temperature
        self.pad_token_id = pad_token_id
        self.device = torch.device(device)
        self.total_iters = total_iters  # optimizer steps in the whole run, for LR decay
        self.max_response_len = max_response_len  # Dr. GRPO's constant normaliser
        self.hf_config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
        init_parallel_state()
        torch.manual_seed(training.seed)
        dtype = torch.bfloat16 if training.bf16 else torch.float32
        self.model = build_gpt_model(self.hf_config, dtype=dtype, device=self.device)
        hf_state = load_hf_state_dict(hf_dir)
        load_hf_weights(self.model, hf_state, self.hf_config)
        self.mixed_precision = training.bf16
        self.param_names = [n for n, _ in self.model.named_parameters()]
        params = [p for _, p in self.model.named_parameters()]
        if self.mixed_precision:
            # Masters come from the original fp32 weights, not from their bf16 rounding.
            full = hf_to_megatron(hf_state, self.hf_config)
            self.master = [full[n].detach().float().to(self.device).clone() for n in self.param_names]
        else:
            self.master = params  # fp32: the model's parameters are the master weights
        self.ref_model = None
        if algorithm.use_kl_loss:
            # A second model, not a deepcopy: megatron modules hold process groups, which do not copy.
            self.ref_model = build_gpt_model(self.hf_config, dtype=dtype, device=self.device)
            load_hf_weights(self.ref_model, hf_state, self.hf_config)
            self.ref_model.eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.master,
            lr=training.lr,
            weight_decay=training.weight_decay,
            betas=(training.adam_beta1, training.adam_beta2),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.weight_version = 0

    def _lr_factor(self, it: int) -> float:
        """Multiplier of lr at optimizer step `it`: linear warmup, then constant, linear or cosine decay."""
        t = self.training
        if t.lr_warmup_iters and it < t.lr_warmup_iters:
            return (it + 1) / t.lr_warmup_iters
        if t.lr_decay_style == "constant":
            return 1.0
        total = (t.lr_decay_iters or self.total_iters or 1) - t.lr_warmup_iters
        progress = min(max(it - t.lr_warmup_iters, 0) / max(total, 1), 1.0)
        floor = t.min_lr / t.lr
        shape = 1.0 - progress if t.lr_decay_style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1.0 - floor) * shape

    def _logprobs(self, model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs_and_entropy(model, ids, temperature=self.temperature)

    def train_rollout(self, samples: list[TrainSample], step: int) -> dict[str, float]:
        """num_steps_per_rollout optimizer steps over one rollout's samples; returns averaged metrics.

        Filters can leave fewer samples than the global batch: the micro-batches are then shared out over
        as many optimizer steps as there are micro-batches (at most num_steps_per_rollout). With no sample
        left, nothing is trained and the weight version stays.
        """
        t = self.training
        if not samples:
            return {"skipped": 1.0}
        t0 = time.perf_counter()
        adv = torch.tensor([s_.advantage for s_ in samples])
        order = list(range(len(samples)))
        random.Random(t.seed * 1_000_003 + step).shuffle(order)
        samples = [samples[i] for i in order]
        mbs = t.micro_batch_size
        batches = [
            collate(samples[i : i + mbs], self.pad_token_id).to(self.device) for i in range(0, len(samples), mbs)
        ]
        # With one optimizer step per rollout the policy is unchanged until the step, so the old log-probs
        # are the current ones, detached (ratio = 1 exactly). Otherwise compute them once, up front.
        old_logps = None
        if t.num_steps_per_rollout > 1:
            with torch.no_grad():
                old_logps = [self._logprobs(self.model, mb.input_ids)[0] for mb in batches]
        n_steps = min(t.num_steps_per_rollout, len(batches))
        per_step = -(-len(batches) // n_steps)  # ceil: a full run has global_batch_size // mbs per step
        metrics: dict[str, list[float]] = {}
        for opt_step in range(n_steps):
            chunk = range(opt_step * per_step, min((opt_step + 1) * per_step, len(batches)))
            old = [old_logps[i] for i in chunk] if old_logps else None
            step_metrics = self._optimizer_step([batches[i] for i in chunk], old)
            for k, v in step_metrics.items():
                metrics.setdefault(k, []).append(v)
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
        return out

    def _optimizer_step(self, batches: list[_MicroBatch], old_logps: list[torch.Tensor] | None) -> dict[str, float]:
        a = self.algorithm
        eps_high = a.eps_clip_high if a.eps_clip_high is not None else a.eps_clip
        n_tokens = float(sum(mb.mask.sum() for mb in batches))
        n_seqs = float(sum(mb.mask.shape[0] for mb in batches))
        # What each aggregation divides by (see losses.aggregate): tokens, sequences, or Dr. GRPO's constant.
        denom = {"token_mean": n_tokens, "seq_mean_token_mean": n_seqs}.get(
            a.loss_agg_mode, float(self.max_response_len or max(int(mb.mask.sum(-1).max()) for mb in batches))
        )
        agg_kw = {"num_seqs": n_seqs} if a.loss_agg_mode == "seq_mean_token_sum_norm" else {}
        self.model.train()
        sums = dict(
            loss=0.0,
            pg_loss=0.0,
            kl=0.0,
            entropy=0.0,
            clipfrac=0.0,
            ratio=0.0,
            logprob_mismatch=0.0,
            logprob_mismatch_max=0.0,
        )
        for i, mb in enumerate(batches):
            logp, entropy = self._logprobs(self.model, mb.input_ids)
            old = old_logps[i] if old_logps is not None else logp.detach()
            if a.advantage_estimator == "gspo":
                pg, clipped = gspo_loss(logp, old, mb.advantages, mb.mask, a.eps_clip, eps_high)
            else:
                pg, clipped = ppo_clip_loss(logp, old, mb.advantages, a.eps_clip, eps_high, clip_c=a.eps_clip_c)
            if a.use_tis:
                pg = pg * tis_weights(old, mb.rollout_logp, a.tis_clip, a.tis_clip_low)
            loss = aggregate(pg, mb.mask, a.loss_agg_mode, denom, **agg_kw)
            sums["pg_loss"] += loss.item()
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_logp = self._logprobs(self.ref_model, mb.input_ids)[0]
                kl = aggregate(kl_penalty(logp, ref_logp, a.kl_loss_type), mb.mask, a.loss_agg_mode, denom, **agg_kw)
                loss = loss + a.kl_loss_coef * kl
                sums["kl"] += kl.item()
            ent = aggregate(entropy, mb.mask, a.loss_agg_mode, denom, **agg_kw)
            if a.entropy_coef:
                loss = loss - a.entropy_coef * ent
            loss.backward()
            sums["loss"] += loss.item()
            sums["entropy"] += ent.item()
            # Token-averaged diagnostics over the whole optimizer step.
            m = mb.mask
            sums["clipfrac"] += float((clipped * m).sum()) / max(n_tokens, 1.0)
            sums["ratio"] += float((torch.exp(logp.detach() - old) * m).sum()) / max(n_tokens, 1.0)
            gap = (logp.detach() - mb.rollout_logp).abs() * m  # training-inference mismatch per token
            sums["logprob_mismatch"] += float(gap.sum()) / max(n_tokens, 1.0)
            sums["logprob_mismatch_max"] = max(sums["logprob_mismatch_max"], float(gap.max()))
        sums["lr"] = self.optimizer.param_groups[0]["lr"]
        grad_norm = self._step_master_weights()
        sums["grad_norm"] = float(grad_norm)
        sums["tokens"] = n_tokens
        if not math.isfinite(sums["loss"]):
            raise FloatingPointError(f"non-finite loss {sums['loss']} at weight version {self.weight_version}")
        return sums

    def _step_master_weights(self) -> torch.Tensor:
        model_params = [p for _, p in self.model.named_parameters()]
        if self.mixed_precision:
            for p, m in zip(model_params, self.master):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        with_grad = [m for m in self.master if m.grad is not None]
        if self.training.clip_grad > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(with_grad, self.training.clip_grad)
        else:
            grad_norm = torch.linalg.vector_norm(torch.stack([m.grad.norm() for m in with_grad]))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.mixed_precision:
            with torch.no_grad():
                for p, m in zip(model_params, self.master):
                    p.copy_(m)
        return grad_norm

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state in megatron names with fp32 master values for every parameter."""
        state = megatron_state_dict(self.model)
        state.update({n: m.detach() for n, m in zip(self.param_names, self.master)})
        return state

    def hf_state_dict(self, include_tied_lm_head: bool = True) -> dict[str, torch.Tensor]:
        return megatron_to_hf(self.master_state_dict(), self.hf_config, include_tied_lm_head=include_tied_lm_head)

    def save(self, path: str | Path, step: int) -> None:
        """Local checkpoint: model, optimizer, LR schedule, RNG states and version, written atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        state = {
            "model": self.master_state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "weight_version": self.weight_version,
            "step": step,
        }
        torch.save(state, tmp)
        tmp.replace(path)

    def load(self, path: str | Path) -> int:
        state = torch.load(path, map_location="cpu", weights_only=False)
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(
                f"{path}: checkpoint does not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        with torch.no_grad():
            for n, m in zip(self.param_names, self.master):
                m.copy_(state["model"][n])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        self.weight_version = state["weight_version"]
        return state["step"]
