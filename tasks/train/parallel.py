"""What tensor and data parallelism change in a training step: what gets reduced and gathered across ranks.

Every rank of the trainer's process group receives the whole step's samples and makes the same plan from them
(tasks/train/micro_batches.py: same shuffle, same micro-batches, this DP rank's share); the ranks of one
tensor-parallel group share a DP rank and so train the same micro-batches. Losses are normalised
by global counts (tokens or sequences of the whole optimizer step), so summing gradients over DP ranks gives the
full-batch gradient exactly (see models.megatron_gpt.allreduce_gradients).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# megatron.core by way of megatron_gpt, whose import silences megatron's expected no-Apex/TE warnings on CPU.
from sluiceway.models.megatron_gpt import parallel_state


def grad_norm(params: list[torch.Tensor], tp_flags: list[bool]) -> torch.Tensor:
    """L2 norm of all gradients of the full (unsharded) model, the same on every rank.

    A tensor-parallel shard holds part of a weight, so its squared norm is summed over the TP group; replicated
    weights (norms) have identical gradients on every TP rank and count once.
    """
    # vector_norm, not grad.pow(2).sum(): ~7x faster on CPU (no squared copy of every gradient).
    sharded = [_sq_norm(p.grad) for p, tp in zip(params, tp_flags) if tp and p.grad is not None]
    replicated = [_sq_norm(p.grad) for p, tp in zip(params, tp_flags) if not tp and p.grad is not None]
    sq_sharded = torch.stack(sharded).sum() if sharded else torch.zeros(())
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(sq_sharded, group=parallel_state.get_tensor_model_parallel_group())
    sq = sq_sharded + (torch.stack(replicated).sum() if replicated else torch.zeros(()))
    return sq.sqrt()


def _sq_norm(g: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(g, dtype=torch.float32).square()


def is_tensor_parallel(param: torch.nn.Parameter) -> bool:
    """Whether megatron sharded this parameter over the TP group (its own attribute, set by the parallel layers)."""
    return bool(getattr(param, "tensor_model_parallel", False)) and (
        parallel_state.get_tensor_model_parallel_world_size() > 1
    )


def reduce_step_metrics(sums: dict[str, float], max_keys: tuple[str, ...] = ()) -> dict[str, float]:
    """Sum the per-rank metric contributions over the DP group (`max_keys`: take the max instead).

    Metrics are accumulated as shares of global counts, so the DP sum is the step's value.
    """
    if parallel_state.get_data_parallel_world_size() == 1:
        return sums
    group = parallel_state.get_data_parallel_group()
    keys = sorted(k for k in sums if k not in max_keys)
    t = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    out = dict(zip(keys, t.tolist()))
    for k in max_keys:
        m = torch.tensor([sums[k]], dtype=torch.float64)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        out[k] = float(m)
    return out


def reduce_step_metric_tensors(
    sums: dict[str, torch.Tensor], max_keys: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """`reduce_step_metrics` for metrics held as 0-dim float64 tensors on the device: the reduction stays there (one
    collective for the sums, one for the maxima), so reading the step's metrics is the step's one wait for the
    device (issue 44)."""
    if parallel_state.get_data_parallel_world_size() == 1:
        return sums
    group = parallel_state.get_data_parallel_group()
    summed = sorted(k for k in sums if k not in max_keys)
    out = {}
    for keys, op in ((summed, dist.ReduceOp.SUM), ([k for k in max_keys if k in sums], dist.ReduceOp.MAX)):
        if keys:
            t = torch.stack([sums[k] for k in keys])
            dist.all_reduce(t, op=op, group=group)
            out |= dict(zip(keys, t.unbind()))
    return out


def gather_tensor_parallel(state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Every TP rank's `state`, in TP rank order (a list of one at TP=1)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return [state]
    out: list = [None] * tp
    group = parallel_state.get_tensor_model_parallel_group()
    dist.all_gather_object(out, {k: v.cpu() for k, v in state.items()}, group=group)
    return out
