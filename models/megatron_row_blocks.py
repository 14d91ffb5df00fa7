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

from sluiceway.models.batch_invariant import stable_linear
from sluiceway.models.megatron_import import _tp_group_or_default, megatron_import

with megatron_import():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


class _RowBlockLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, allreduce_dgrad: bool,
                tp_group: Any) -> Tensor:  # fmt: skip
        ctx.save_for_backward(x, weight)
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad, ctx.tp_group = allreduce_dgrad, tp_group
        return stable_linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        if grad_x is not None and ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_x, group=_tp_group_or_default(ctx.tp_group))
        g2 = grad.reshape(-1, grad.size(-1))
        grad_w = g2.t().matmul(x.reshape(-1, x.size(-1))) if ctx.needs_input_grad[1] else None
        grad_b = g2.sum(dim=0) if ctx.use_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None


def _row_block_forward(megatron_impl: Any, input: Tensor, weight: Tensor, bias: Tensor | None,
                       gradient_accumulation_fusion: bool, allreduce_dgrad: bool, sequence_parallel: bool,
                       *args: Any, tp_group: Any = None, **kwargs: Any) -> Tensor:  # fmt: skip
    if sequence_parallel or (gradient_accumulation_fusion and hasattr(weight, "main_grad")):
        return megatron_impl(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                             *args, tp_group=tp_group, **kwargs)  # fmt: skip
    return _RowBlockLinear.apply(input, weight, bias, allreduce_dgrad, tp_group)


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
