"""One training client's model: Tinker's forward_backward (per-token log-probs and loss, gradients accumulated)
and optim_step (Adam with the step's own parameters) on a PolicyTrainer, which builds the megatron model, its
LoRA adapters or full weights, the fp32 masters and AdamW, and writes weight versions.

Not the RL path (PolicyTrainer.train_rollout plans micro-batches from rollout rows and computes its own
advantages); Tinker hands over finished per-token inputs, so this scores them directly with `logprobs_at`.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np
import torch

from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
from sluiceway.flows.tinker.adam import check_adam
from sluiceway.flows.tinker.futures import TinkerUserError
from sluiceway.flows.tinker.losses import LOSS_INPUTS, elementwise_loss, loss_config
from sluiceway.flows.tinker.wire import DatumIn

# Token positions (datums x their longest, padded) one micro-batch of a forward_backward holds: its activations and
# graph are freed before the next, so a cookbook batch of 256 episodes takes a few GB instead of all of them at once
# (issue 52: tinker-cookbook's guess_number on SmolLM2 reached 23 GB). SmolLM2-135M, LoRA 32, 16 datums of 800
# tokens: the server's peak 8.2 GB at 4096 positions, 2.6 GB at 1024 (docs/benchmarks.md, "Tinker server memory").
MICRO_BATCH_TOKENS = 1024


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive datums grouped so that count x longest <= `budget` (a longer datum alone); their order kept."""
    out: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if cur and (len(cur) + 1) * max(longest, n) > budget:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


class TinkerModel:
    def __init__(self, model_id: str, hf_dir: Path, lora_rank: int, seed: int | None, device: str) -> None:
        from sluiceway.models.zoo import load_tokenizer
        from sluiceway.tasks.train.trainer import PolicyTrainer

        self.model_id, self.hf_dir, self.lora_rank, self.seed = model_id, Path(hf_dir), lora_rank, seed
        self.tokenizer = load_tokenizer(hf_dir)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # bf16 where a GPU trains; fp32 on a CPU. clip_grad 0: the step's AdamParams.grad_clip_norm decides.
        training = TrainingConfig(hf_checkpoint=str(hf_dir), lora_rank=lora_rank, bf16=device != "cpu",
                                  clip_grad=0.0, seed=1234 if seed is None else seed)  # fmt: skip
        self.trainer = PolicyTrainer(hf_dir, training, AlgorithmConfig(), 1.0, pad, device=device)
        self.vocab = self.trainer.hf_config.vocab_size
        self.steps = 0  # optimizer steps taken
        self.saved = 0  # weight versions written (their directory numbers)
        self.lock = threading.Lock()  # the runner thread trains; get_info only reads
        self.micro_batch_tokens = MICRO_BATCH_TOKENS

    def forward_backward(
        self, data: list[DatumIn], loss_fn: str, config: dict, forward_only: bool
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per-datum outputs (`logprobs`, `elementwise_loss`) and metrics (`loss:sum`); with a backward, the loss's
        gradient is added to what earlier calls accumulated, until optim_step applies it (Tinker's semantics)."""
        settings = loss_config(loss_fn, config)
        if not data:
            raise TinkerUserError("forward_backward needs at least one datum")
        tensors = [self._check(i, d, loss_fn) for i, d in enumerate(data)]
        t = self.trainer
        outputs: list[dict[str, np.ndarray]] = []
        total = 0.0
        with self.lock, torch.set_grad_enabled(not forward_only):
            t.model.train(not forward_only)
            chunks = micro_batches([len(d.tokens) for d in data], self.micro_batch_tokens)
            # Backward adds into .grad in place: a copy, to take back if a later micro-batch fails.
            keep = not forward_only and len(chunks) > 1
            before = [None if p.grad is None else p.grad.clone() for p in t.trainable.parameters()] if keep else None
            try:
                for chunk in chunks:
                    part = [tensors[i] for i in chunk]
                    logps = self._logprobs([data[i].tokens for i in chunk], [x["target_tokens"] for x in part])
                    losses = [elementwise_loss(loss_fn, lp, inputs, settings) for lp, inputs in zip(logps, part)]
                    loss = torch.stack([x.sum() for x in losses]).sum()
                    if not forward_only:
                        bad = [i for i, x in zip(chunk, losses) if not bool(torch.isfinite(x.detach()).all())]
                        if bad:  # its gradient would reach the weights at the next optim_step
                            raise TinkerUserError(f"datum {bad[0]}: its {loss_fn} loss is not finite (a log-prob "
                                                  "ratio beyond float range?); nothing of this forward_backward "
                                                  "was accumulated")  # fmt: skip
                        loss.backward()  # the graph of this micro-batch goes: memory is one micro-batch's
                    total += float(loss.detach())
                    outputs += [
                        {"logprobs": lp.detach().float().cpu().numpy(),
                         "elementwise_loss": x.detach().float().cpu().numpy()}
                        for lp, x in zip(logps, losses)
                    ]  # fmt: skip
            except BaseException:
                if before is not None:  # what earlier micro-batches of this call added is taken back
                    for p, g in zip(t.trainable.parameters(), before):
                        p.grad = g
                raise
        return outputs, {"loss:sum": total}

    def _check(self, i: int, d: DatumIn, loss_fn: str) -> dict[str, torch.Tensor]:
        """The datum's loss inputs as tensors on the trainer's device, each the length of its tokens."""
        n = len(d.tokens)
        if n == 0:
            raise TinkerUserError(f"datum {i}: empty model_input")
        if any(not 0 <= tok < self.vocab for tok in d.tokens):
            raise TinkerUserError(f"datum {i}: a token id outside the vocabulary [0, {self.vocab})")
        out = {}
        required, optional = LOSS_INPUTS[loss_fn]
        for name in required + optional:
            if name not in d.inputs:
                if name in optional:  # weights: every target counts; clip thresholds: loss_fn_config's
                    continue
                raise TinkerUserError(f"datum {i}: {loss_fn} needs loss_fn_inputs[{name!r}]")
            a = np.asarray(d.inputs[name])
            if a.ndim != 1 or a.shape[0] != n:
                raise TinkerUserError(
                    f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(a.shape)}, expected [{n}] (one per token;"
                    " 2-D targets are not implemented)"
                )
            if name == "target_tokens" and a.dtype.kind not in "iu":  # 1.5 is no token: never truncated to 1
                raise TinkerUserError(f"datum {i}: loss_fn_inputs['target_tokens'] must be integers, got {a.dtype}")
            if name != "target_tokens" and (a.dtype.kind not in "iuf" or not np.isfinite(a).all()):
                raise TinkerUserError(f"datum {i}: loss_fn_inputs[{name!r}] must be finite numbers")
            dtype = torch.long if name == "target_tokens" else torch.float32
            out[name] = torch.as_tensor(a, dtype=dtype, device=self.trainer.device)
        if not bool(((out["target_tokens"] >= 0) & (out["target_tokens"] < self.vocab)).all()):
            raise TinkerUserError(f"datum {i}: a target token outside the vocabulary [0, {self.vocab})")
        return out

    def _logprobs(self, token_lists: list[list[int]], targets: list[torch.Tensor]) -> list[torch.Tensor]:
        """log p(target_t | tokens[:t+1]) for every position of every datum, in one batch padded on the right
        (the attention is causal, so padding after a datum changes none of its positions)."""
        from sluiceway.models.megatron_logprobs import logprobs_at

        t = self.trainer
        width = max(len(x) for x in token_lists)
        ids = torch.full((len(token_lists), width), t.pad_token_id, dtype=torch.long)
        for r, toks in enumerate(token_lists):
            ids[r, : len(toks)] = torch.as_tensor(toks)
        rows = torch.cat([torch.full((len(x),), r, dtype=torch.long) for r, x in enumerate(token_lists)])
        positions = torch.cat([torch.arange(len(x)) for x in token_lists])
        dev = t.device
        logp, _ = logprobs_at(t.model, ids.to(dev), rows.to(dev), positions.to(dev), torch.cat(targets).to(dev), 1.0)
        return list(torch.split(logp, [len(x) for x in token_lists]))

    def optim_step(self, params: dict) -> dict[str, float]:
        """One AdamW step with the request's parameters (checked by `check_adam` first); a gradient that is not
        finite is dropped and the weights stay as they were (the run's trainer does the same)."""
        from sluiceway.tasks.train.optim import step_master_weights

        check_adam(params)

        def finite(norm: torch.Tensor) -> None:
            if not math.isfinite(float(norm)):
                raise TinkerUserError(f"optim_step: the accumulated gradient is not finite (norm {float(norm)}); "
                                      "it was dropped and the weights are unchanged")  # fmt: skip

        t = self.trainer
        with self.lock:
            for g in t.optimizer.param_groups:
                g["lr"] = float(params.get("learning_rate", 1e-4))
                g["betas"] = (float(params.get("beta1", 0.9)), float(params.get("beta2", 0.95)))
                g["eps"] = float(params.get("eps", 1e-12))
                g["weight_decay"] = float(params.get("weight_decay", 0.0))
            norm = step_master_weights(t.trainable, t.master, t.optimizer, t.scheduler, t.tp_flags,
                                       float(params.get("grad_clip_norm", 0.0)), t.mixed_precision, finite,
                                       t.rounding)  # fmt: skip
            # The schedule's step reset lr to its own; the next optim_step sets it again from its params.
            self.steps += 1
            t.weight_version = self.steps
        return {"grad_norm:mean": float(norm), "learning_rate:mean": float(params.get("learning_rate", 1e-4))}

    def save_for_sampler(self, root: Path) -> Path:
        """The current weights as a new HF model directory under `root` (adapters merged), for an engine to load.
        Every save keeps its own directory (keep=0): a sampler path the client holds must stay valid."""
        from sluiceway.tasks.sync.disk import write_weight_version

        with self.lock:
            self.saved += 1
            state = self.trainer.hf_state_dict(include_tied_lm_head=False)
            dtype = "bfloat16" if self.trainer.mixed_precision else None
            return write_weight_version(state, self.hf_dir, root, self.saved, keep=0, dtype=dtype)

    def save_state(self, local_dir: Path) -> None:
        """A trainer checkpoint (tasks/train/checkpoint.py: fp32 masters, the adapters alone with LoRA, Adam's
        state, RNG) in `local_dir`, its step the optimizer steps taken."""
        with self.lock:
            self.trainer.save(local_dir, self.steps)

    def load_state(self, local_dir: Path, optimizer: bool) -> None:
        """Restore a `save_state` checkpoint; without `optimizer`, Adam starts afresh (Tinker's load_state and
        create_training_client_from_state) while the weights are the saved ones."""
        from collections import defaultdict

        t = self.trainer
        with self.lock:
            self.steps = t.load(local_dir)
            if not optimizer:
                t.optimizer.state = defaultdict(dict)
            t.weight_version = self.steps
            for p in t.trainable.parameters():  # nothing accumulated before the load counts after it
                p.grad = None
