"""`--use-distributed-optimizer`: the fp32 master weights and AdamW's moments sharded over the data-parallel group.

ZeRO-1, laid out as Megatron's distributed optimizer lays it out: the model's parameters become views of one flat
buffer (in the model's dtype), cut into DP equal contiguous shards; DP rank r keeps the fp32 masters and both Adam
moments of shard r only, and AdamW (fused, over that one flat tensor) updates it. A step is: the gradients are
all-reduced as without the flag (models/megatron_gpt.allreduce_gradients), the full gradient norm is taken as
without it (every rank holds every gradient), each rank clips and steps its shard, and the updated shards are
all-gathered straight into the flat buffer, so every rank's model holds the new weights. In fp32 the model's
weights are the masters, so a rank's masters are a view of its shard of the buffer and cost nothing more; with
bf16 they are a separate fp32 shard. Optimizer memory per rank: 12/DP bytes a parameter with bf16 compute
(12 without the flag), 8/DP in fp32 (8 without): tasks/train/optim.state_bytes_per_rank, which the memory plan asks.

AdamW is elementwise, so stepping a shard gives the bits the unsharded optimizer gives those elements (the same
gradients, the same clip coefficient, the same step count). One difference: a parameter with no gradient steps with
a zero gradient (weight decay and moment decay apply), as every parameter does at DP > 1 without the flag, where
allreduce_gradients gives it zeros; without the flag at DP = 1 it would be skipped.

Checkpoints keep the unsharded layout (`state_dict` gathers the shards into torch AdamW's per-parameter state on
DP rank 0, `load_state_dict` takes this rank's slice of it), so one saved at any DP size, with or without the flag,
loads at any other.

Why not torch's ZeroRedundancyOptimizer: it shards by whole parameter (uneven: one embedding can be most of a
small model) and only the optimizer's state; with bf16 compute every rank would still hold all the fp32 masters,
which it broadcasts in full after each step. Megatron's own DistributedOptimizer reads the grad buffers of
megatron's DistributedDataParallel, which are CUDA-only (see models/megatron_gpt.allreduce_gradients), and the
trainer keeps its GPTModel unwrapped, on CPU too.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from sluiceway.flows.config import TrainingConfig
from sluiceway.models.megatron_gpt import parallel_state
from sluiceway.tasks.train.optim import adamw, dp_shard
from sluiceway.tasks.train.parallel import grad_norm

# all_gather_into_tensor's new name (the old one warns); both gather in place on gloo and NCCL.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardedAdamW:
    """This DP rank's shard of the fp32 masters and AdamW over it; the model's parameters become views of `buffer`.

    `masters`: the fp32 master value of every parameter (named_parameters order) when the model computes in a
    lower precision; None when the model's fp32 parameters are the masters.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        masters: list[torch.Tensor] | None,
        training: TrainingConfig,
        lr: float | None = None,
        group: Any = None,
    ):
        self.params = [p for _, p in model.named_parameters()]
        self.group = parallel_state.get_data_parallel_group() if group is None else group
        self.dp = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"the distributed optimizer needs one parameter dtype, the model has {dtypes}")
        self.numels = [p.numel() for p in self.params]
        self.offsets = [0, *itertools.accumulate(self.numels)][:-1]
        self.total = sum(self.numels)
        self.shard = dp_shard(self.total, self.dp)  # the last shard is padded with zeros
        self.lo = self.rank * self.shard
        first = self.params[0]
        self.buffer = torch.zeros(self.shard * self.dp, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, off, n in zip(self.params, self.offsets, self.numels):
                self.buffer[off : off + n].copy_(p.reshape(-1))
                p.data = self.buffer[off : off + n].view_as(p)
        mine = self.buffer[self.lo : self.lo + self.shard]
        self.separate_masters = masters is not None
        if masters is None:
            if first.dtype != torch.float32:
                raise ValueError("without separate fp32 masters the parameters must be fp32")
            self.master = mine  # the weights are the masters
        else:
            self.master = self.slice(masters)
        self.optimizer = adamw([self.master], training, lr)
        self.rounding = None  # tasks/train/weight_rounding.MasterRounding, set by the trainer with bf16 compute

    def slice(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's shard of per-parameter tensors (full shapes, named_parameters order), flat fp32."""
        out = torch.zeros(self.shard, dtype=torch.float32, device=self.buffer.device)
        hi = self.lo + self.shard
        for t, off, n in zip(tensors, self.offsets, self.numels):
            a, b = max(off, self.lo), min(off + n, hi)
            if a < b and t is not None:
                out[a - self.lo : b - self.lo].copy_(t.detach().reshape(-1)[a - off : b - off])
        return out

    def _unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[off : off + n].view_as(p) for p, off, n in zip(self.params, self.offsets, self.numels)]

    def _gather(self, shard: torch.Tensor, to_first: bool = False) -> torch.Tensor | None:
        """Every rank's `shard` concatenated: on every rank, or (`to_first`) on DP rank 0 only (None elsewhere)."""
        if self.dp == 1:
            return shard
        if not to_first:
            out = torch.empty(self.shard * self.dp, dtype=shard.dtype, device=shard.device)
            _all_gather_flat(out, shard, group=self.group)
            return out
        parts = [torch.empty_like(shard) for _ in range(self.dp)] if self.rank == 0 else None
        dist.gather(shard, parts, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return None if parts is None else torch.cat(parts)

    def step(
        self,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        tp_flags: list[bool],
        clip_grad: float,
        check: Callable[[torch.Tensor], None] | None = None,
    ):
        """Clip by the full model's gradient norm, step AdamW on this shard and the LR schedule, all-gather the new
        weights into every rank's model; returns the norm. Call after the gradients are all-reduced over DP.
        `check(norm)` runs before anything is stepped; if it raises, the gradients are dropped and nothing changes."""
        total_norm = grad_norm(self.params, tp_flags)
        if check is not None:
            try:
                check(total_norm)
            except BaseException:
                for p in self.params:
                    p.grad = None
                raise
        self.master.grad = self.slice([p.grad for p in self.params])
        for p in self.params:
            p.grad = None
        if clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_([self.master], clip_grad, total_norm)
        self.optimizer.step()
        scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            mine = self.buffer[self.lo : self.lo + self.shard]
            if self.separate_masters:  # rounded to the model's dtype, as without the flag (tasks/train/optim.py)
                if self.rounding is not None:
                    self.rounding.copy_flat(mine, self.master, self.lo)
                else:
                    mine.copy_(self.master)
            if self.dp > 1:
                _all_gather_flat(self.buffer, mine, group=self.group)
        return total_norm

    def full_masters(self) -> list[torch.Tensor]:
        """Every parameter's fp32 master value (a collective over DP with bf16 compute; in fp32, the weights)."""
        if not self.separate_masters:
            return [p.detach() for p in self.params]
        return self._unflatten(self._gather(self.master))

    def load_masters(self, values: list[torch.Tensor]) -> None:
        """Set the masters from every parameter's full fp32 value (the model's weights are the caller's to load)."""
        with torch.no_grad():
            self.master.copy_(self.slice(values))

    def state_dict(self) -> dict[str, Any] | None:
        """torch AdamW's state_dict as the trainer without the flag has it (one entry per parameter, full shapes) on
        DP rank 0, None on the others. A collective over DP."""
        inner = self.optimizer.state_dict()
        group = dict(inner["param_groups"][0], params=list(range(len(self.params))))
        shard = inner["state"].get(0)
        if shard is None:  # no step yet
            return {"state": {}, "param_groups": [group]} if self.rank == 0 else None
        moments = {k: self._gather(shard[k], to_first=True) for k in ("exp_avg", "exp_avg_sq")}
        if self.rank != 0:
            return None
        full = {k: self._unflatten(v) for k, v in moments.items()}
        state = {
            i: {"step": shard["step"].clone()} | {k: full[k][i].clone() for k in ("exp_avg", "exp_avg_sq")}
            for i in range(len(self.params))
        }
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, full: dict[str, Any]) -> None:
        """Take this rank's shard of a full (per-parameter) AdamW state_dict, saved with or without the flag."""
        (group,) = full["param_groups"]
        if len(group["params"]) != len(self.params):
            raise ValueError(f"optimizer state for {len(group['params'])} parameters, the model has {len(self.params)}")
        per_param = [full["state"].get(key) for key in group["params"]]  # the state's keys, in parameter order
        state = {}
        have = [s for s in per_param if s is not None]
        if have:
            state[0] = {"step": have[0]["step"]} | {
                k: self.slice([None if s is None else s[k] for s in per_param]) for k in ("exp_avg", "exp_avg_sq")
            }
        self.optimizer.load_state_dict({"state": state, "param_groups": [dict(group, params=[0])]})

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: its fp32 masters (when separate from the weights) and moments."""
        return state_bytes(self.optimizer, [self.master] if self.separate_masters else [])


def state_bytes(optimizer: torch.optim.Optimizer, masters: list[torch.Tensor]) -> int:
    """Bytes of the tensors in `optimizer`'s state (Adam's moments and step counts) and of `masters`, the fp32 master
    weights where they are not the model's own parameters."""
    tensors = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)] + list(masters)
    return sum(t.numel() * t.element_size() for t in tensors)


def restore_optimizer(owner: Any, masters: list[torch.Tensor], optimizer_state: dict) -> None:
    """Load a checkpoint's full fp32 masters and optimizer state into `owner` (the policy trainer or the critic:
    `.zero`, or `.master` and `.optimizer`); a sharded owner keeps only its slice."""
    if owner.zero is not None:
        owner.zero.load_masters(masters)
        owner.zero.load_state_dict(optimizer_state)
        return
    with torch.no_grad():
        for m, v in zip(owner.master, masters):
            m.copy_(v)
    owner.optimizer.load_state_dict(optimizer_state)
