"""What the policy trainer trains of its model: every weight (`FullWeights`), or LoRA adapters on a frozen base
(`LoraTransform`, --lora-rank, models/lora.py).

The trainer composes one of these (`model_transform`) and never asks which: each answers the questions where the
two differ, namely which parameters train and whether they need fp32 master copies, how the frozen reference is
seen, what the trained state, gradients and published weights are called, and how to publish an adapter alone.
Each also says what it would hold for a model shape without building anything (`planned_training`, which the memory
plan asks), so this module imports torch, megatron and the model code only inside the methods that use them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sluiceway.flows.config import LoraPart

if TYPE_CHECKING:
    import torch
    from torch import Tensor


@dataclass(frozen=True)
class TrainedPart:
    """What a transform trains on one TP rank, as the memory plan needs it (tasks/train/memory_plan.py)."""

    parameters: int  # trained parameters (this TP rank's share)
    width: int  # bytes of each trained weight and of its gradient in backward
    separate_masters: bool  # the trained weights step through fp32 master copies
    reference_bytes: int  # a frozen reference (KL) as a model of its own; 0: the transform computes it without one


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

    @staticmethod
    def planned(base_parameters: int, bf16: bool) -> TrainedPart:
        """Every weight trains in the compute dtype, through fp32 masters with bf16; the reference is a second model."""
        width = 2 if bf16 else 4
        return TrainedPart(base_parameters, width, separate_masters=bf16, reference_bytes=base_parameters * width)

    def fp32_masters(self, hf_state: dict[str, Tensor], names: list[str]) -> list[Tensor]:
        from sluiceway.models.hf_megatron import hf_to_megatron

        # From the original fp32 weights, not from their bf16 rounding.
        full = hf_to_megatron(hf_state, self.hf_config, tp_rank=self.tp_rank, tp_size=self.tp_size)
        return [full[n].detach().float().to(self.device).clone() for n in names]

    def frozen_base(self) -> None:
        return None  # every weight moves, so the reference is a second model

    def gradients(self) -> dict[str, Tensor]:
        from sluiceway.models.hf_megatron import megatron_to_hf, merge_tp_shards
        from sluiceway.tasks.train.parallel import gather_tensor_parallel

        grads = {n: p.grad.detach().float().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.model.zero_grad(set_to_none=True)
        full = merge_tp_shards(gather_tensor_parallel(grads), self.hf_config)
        return megatron_to_hf(full, self.hf_config, include_tied_lm_head=False)

    def trained_state(self) -> dict[str, Tensor]:
        from sluiceway.models.hf_megatron import megatron_state_dict

        return megatron_state_dict(self.model)

    def hf_state_dict(self, masters: Callable[[], dict[str, Tensor]], include_tied_lm_head: bool) -> dict[str, Tensor]:
        from sluiceway.models.hf_megatron import megatron_to_hf, merge_tp_shards
        from sluiceway.tasks.train.parallel import gather_tensor_parallel

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
        from sluiceway.models.lora import LoraAdapters, lora_spec

        self.model, self.hf_config = model, hf_config
        model.requires_grad_(False)
        self.adapters = LoraAdapters(hf_config, lora_spec(lora), seed, device)
        self.adapters.attach(model)
        self.trainable = self.adapters
        self.separate_masters = False

    @staticmethod
    def planned(hf_config: Any, rank: int, targets: tuple[str, ...], tp_size: int) -> TrainedPart:
        """Only the fp32 adapters train (their own masters); the reference is the base with them off, no model."""
        from sluiceway.models.lora import adapter_parameters

        return TrainedPart(adapter_parameters(hf_config, rank, targets, tp_size), 4, separate_masters=False,
                           reference_bytes=0)  # fmt: skip

    def fp32_masters(self, hf_state: dict[str, Tensor], names: list[str]) -> list[Tensor]:
        raise ValueError("LoRA adapters are fp32: they are their own masters")

    def frozen_base(self) -> Callable[[], contextlib.AbstractContextManager]:
        return self.adapters.disabled  # the frozen reference costs no second model

    def gradients(self) -> dict[str, Tensor]:
        from sluiceway.models.lora import merge_tp_adapters
        from sluiceway.tasks.train.parallel import gather_tensor_parallel

        grads = {n: g.grad.detach().float().clone() for n, g in self.adapters.local_params().items()}
        self.adapters.zero_grad(set_to_none=True)
        return merge_tp_adapters(gather_tensor_parallel(grads))

    def trained_state(self) -> dict[str, Tensor]:
        return dict(self.adapters.state_dict())  # the adapters alone: the base never changes

    def hf_state_dict(self, masters: Callable[[], dict[str, Tensor]], include_tied_lm_head: bool) -> dict[str, Tensor]:
        from sluiceway.models.hf_megatron import megatron_state_dict, megatron_to_hf, merge_tp_shards
        from sluiceway.models.lora import merge_into_hf
        from sluiceway.tasks.train.parallel import gather_tensor_parallel

        # The adapters are their own masters, so the base and the adapters are read from the model as it is.
        base = merge_tp_shards(gather_tensor_parallel(megatron_state_dict(self.model)), self.hf_config)
        base = megatron_to_hf(base, self.hf_config, include_tied_lm_head=include_tied_lm_head)
        return merge_into_hf(base, self.adapter_state_dict(), self.adapters.spec)

    def adapter_state_dict(self) -> dict[str, Tensor]:
        from sluiceway.models.lora import merge_tp_adapters
        from sluiceway.tasks.train.parallel import gather_tensor_parallel

        return merge_tp_adapters(gather_tensor_parallel(self.adapters.local_state()))

    def write_adapter(self, adapter: dict[str, Tensor], hf_dir: Path, root: Path, version: int) -> Path:
        from sluiceway.tasks.sync.disk import write_adapter_version

        return write_adapter_version(adapter, self.adapters.spec, hf_dir, root, version)


def model_transform(model: torch.nn.Module, hf_config: Any, training: Any, tp_rank: int, tp_size: int,
                    device: torch.device) -> ModelTransform:  # fmt: skip
    """The transform a TrainingConfig asks for, applied to `model` (LoRA attaches its adapters and freezes it)."""
    if training.lora is not None:
        return LoraTransform(model, hf_config, training.lora, training.seed, device)
    return FullWeights(model, hf_config, training.bf16, tp_rank, tp_size, device)


def planned_training(hf_config: Any, lora_rank: int, lora_targets: tuple[str, ...], base_parameters: int, bf16: bool,
                     tp_size: int) -> TrainedPart:  # fmt: skip
    """What `model_transform` would train for this shape and config, without building it (lora_rank 0: no LoRA);
    `base_parameters`: the model's parameters on one TP rank."""
    if lora_rank:
        return LoraTransform.planned(hf_config, lora_rank, lora_targets, tp_size)
    return FullWeights.planned(base_parameters, bf16)
