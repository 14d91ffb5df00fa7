"""What the policy trainer trains of its model: every weight (`FullWeights`), or LoRA adapters on a frozen base
(`LoraTransform`, --lora-rank, models/lora.py).

The trainer composes one of these (`model_transform`) and never asks which: each answers the questions where the
two differ, namely which parameters train and whether they need fp32 master copies, how the frozen reference is
seen, what the trained state, gradients and published weights are called, and how to publish an adapter alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from sluiceway.flows.config import LoraPart
from sluiceway.models.hf_megatron import hf_to_megatron, megatron_state_dict, megatron_to_hf, merge_tp_shards
from sluiceway.models.lora import LoraAdapters, lora_spec, merge_into_hf, merge_tp_adapters
from sluiceway.tasks.sync.disk import write_adapter_version
from sluiceway.tasks.train.parallel import gather_tensor_parallel


class ModelTransform(Protocol):
    trainable: torch.nn.Module  # what the optimizer, gradient all-reduce and checkpoints see
    separate_masters: bool  # the trainable weights compute in bf16 and train through fp32 master copies

    def fp32_masters(self, hf_state: dict[str, Tensor], names: list[str]) -> list[Tensor]:
        """fp32 masters of the `names` parameters (when `separate_masters`), from the original weights."""
        ...

    def frozen_base(self) -> Callable[[], contextlib.AbstractContextManager] | None:
        """A context under which the policy model computes the frozen reference, or None: it needs its own model."""
        ...

    def gradients(self) -> dict[str, Tensor]:
        """The trainable part's whole gradients (TP shards gathered; a collective), named as published; cleared."""
        ...

    def trained_state(self) -> dict[str, Tensor]:
        """This rank's state dict of the trainable part (what a checkpoint's "model" holds, before the masters)."""
        ...

    def hf_state_dict(self, masters: Callable[[], dict[str, Tensor]], include_tied_lm_head: bool) -> dict[str, Tensor]:
        """The whole model in HF names (a collective); `masters` gives this rank's trained state in fp32."""
        ...

    def adapter_state_dict(self) -> dict[str, Tensor]:
        """The whole adapter in peft's keys (a collective)."""
        ...

    def write_adapter(self, adapter: dict[str, Tensor], hf_dir: Path, root: Path, version: int) -> Path:
        """Publish `adapter` as peft's adapter directory for weight version `version` under `root`."""
        ...


class FullWeights:
    """Every weight of the model trains (no --lora-rank); with bf16 through fp32 masters."""

    def __init__(self, model: torch.nn.Module, hf_config: Any, bf16: bool, tp_rank: int, tp_size: int,
                 device: torch.device):  # fmt: skip
        self.model, self.hf_config, self.device = model, hf_config, device
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.trainable = model
        self.separate_masters = bf16

    def fp32_masters(self, hf_state: dict[str, Tensor], names: list[str]) -> list[Tensor]:
        # From the original fp32 weights, not from their bf16 rounding.
        full = hf_to_megatron(hf_state, self.hf_config, tp_rank=self.tp_rank, tp_size=self.tp_size)
        return [full[n].detach().float().to(self.device).clone() for n in names]

    def frozen_base(self) -> None:
        return None  # every weight moves, so the reference is a second model

    def gradients(self) -> dict[str, Tensor]:
        grads = {n: p.grad.detach().float().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.model.zero_grad(set_to_none=True)
        full = merge_tp_shards(gather_tensor_parallel(grads), self.hf_config)
        return megatron_to_hf(full, self.hf_config, include_tied_lm_head=False)

    def trained_state(self) -> dict[str, Tensor]:
        return megatron_state_dict(self.model)

    def hf_state_dict(self, masters: Callable[[], dict[str, Tensor]], include_tied_lm_head: bool) -> dict[str, Tensor]:
        full = merge_tp_shards(gather_tensor_parallel(masters()), self.hf_config)
        return megatron_to_hf(full, self.hf_config, include_tied_lm_head=include_tied_lm_head)

    def adapter_state_dict(self) -> dict[str, Tensor]:
        raise ValueError("no adapter to publish: the whole model trains (adapters need --lora-rank)")

    def write_adapter(self, adapter: dict[str, Tensor], hf_dir: Path, root: Path, version: int) -> Path:
        raise ValueError("no adapter to publish: the whole model trains (adapters need --lora-rank)")


class LoraTransform:
    """--lora-rank: the base is frozen and only the adapters train (models/lora.py). The adapters are fp32 whatever
    the model computes in, so they are their own masters; the reference is the base with the adapters switched off."""

    def __init__(self, model: torch.nn.Module, hf_config: Any, lora: LoraPart, seed: int, device: torch.device):
        self.model, self.hf_config = model, hf_config
        model.requires_grad_(False)
        self.adapters = LoraAdapters(hf_config, lora_spec(lora), seed, device)
        self.adapters.attach(model)
        self.trainable = self.adapters
        self.separate_masters = False

    def fp32_masters(self, hf_state: dict[str, Tensor], names: list[str]) -> list[Tensor]:
        raise ValueError("LoRA adapters are fp32: they are their own masters")

    def frozen_base(self) -> Callable[[], contextlib.AbstractContextManager]:
        return self.adapters.disabled  # the frozen reference costs no second model

    def gradients(self) -> dict[str, Tensor]:
        grads = {n: g.grad.detach().float().clone() for n, g in self.adapters.local_params().items()}
        self.adapters.zero_grad(set_to_none=True)
        return merge_tp_adapters(gather_tensor_parallel(grads))

    def trained_state(self) -> dict[str, Tensor]:
        return dict(self.adapters.state_dict())  # the adapters alone: the base never changes

    def hf_state_dict(self, masters: Callable[[], dict[str, Tensor]], include_tied_lm_head: bool) -> dict[str, Tensor]:
        # The adapters are their own masters, so the base and the adapters are read from the model as it is.
        base = merge_tp_shards(gather_tensor_parallel(megatron_state_dict(self.model)), self.hf_config)
        base = megatron_to_hf(base, self.hf_config, include_tied_lm_head=include_tied_lm_head)
        return merge_into_hf(base, self.adapter_state_dict(), self.adapters.spec)

    def adapter_state_dict(self) -> dict[str, Tensor]:
        return merge_tp_adapters(gather_tensor_parallel(self.adapters.local_state()))

    def write_adapter(self, adapter: dict[str, Tensor], hf_dir: Path, root: Path, version: int) -> Path:
        return write_adapter_version(adapter, self.adapters.spec, hf_dir, root, version)


def model_transform(model: torch.nn.Module, hf_config: Any, training: Any, tp_rank: int, tp_size: int,
                    device: torch.device) -> ModelTransform:  # fmt: skip
    """The transform a TrainingConfig asks for, applied to `model` (LoRA attaches its adapters and freezes it)."""
    if training.lora is not None:
        return LoraTransform(model, hf_config, training.lora, training.seed, device)
    return FullWeights(model, hf_config, training.bf16, tp_rank, tp_size, device)
