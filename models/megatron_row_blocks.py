"""megatron-core's parallel linear layers with the embedded engine's row blocks in forward (CPUs with AMX).

Where a bf16 product's row depends on the rows beside it (models/batch_invariant.py `rows_vary`, as on AMX),
the engine runs every product in blocks of ROW_BLOCK rows. The trainer's forward must give a sampled token the
same log-prob, so its ColumnParallelLinear and RowParallelLinear layers (the output layer included) compute
their forward the same way. Backward is megatron's arithmetic unchanged (grad input = g W, grad weight = g^T x,
grad bias = sum of g; the input gradient all-reduced over the tensor-parallel group where megatron would): the
gradients' bits do not change, only the forward's, and only on such CPUs.

The layers keep their class and parameters; each instance's `_forward_impl` (megatron's seam between the layer
and its linear function) is replaced. Sequence parallelism and gradient-accumulation fusion are GPU features
and keep megatron's own function.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from sluiceway.models.batch_invariant import RowBlockLinear
from sluiceway.models.megatron_import import _tp_group_or_default, megatron_import

with megatron_import():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


def _row_block_forward(megatron_impl: Any, input: Tensor, weight: Tensor, bias: Tensor | None,
                       gradient_accumulation_fusion: bool, allreduce_dgrad: bool, sequence_parallel: bool,
                       *args: Any, tp_group: Any = None, **kwargs: Any) -> Tensor:  # fmt: skip
    if sequence_parallel or (gradient_accumulation_fusion and hasattr(weight, "main_grad")):
        return megatron_impl(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                             *args, tp_group=tp_group, **kwargs)  # fmt: skip
    # The input gradient is all-reduced over the tensor-parallel group where megatron's function would.
    return RowBlockLinear.apply(input, weight, bias, _tp_group_or_default(tp_group) if allreduce_dgrad else None)


def use_row_blocks(model: torch.nn.Module) -> int:
    """Every parallel linear layer of `model` computes its forward in row blocks; returns how many. Idempotent."""
    n = 0
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            impl = module._forward_impl
            if not (isinstance(impl, functools.partial) and impl.func is _row_block_forward):
                module._forward_impl = functools.partial(_row_block_forward, impl)
            n += 1
    return n
