"""Trainer checkpoints on local disk: what a checkpoint directory holds, written and read back.

    <dir>/tp<r>.pt     per tensor-parallel rank: fp32 master weights (megatron names; with --lora-rank the adapters
                       alone, models/lora.py), optimizer, LR schedule, RNG states, weight version, step, and the
                       PPO critic's state (or None)
    <dir>/meta.json    {"step", "weight_version", "tensor_parallel"}

The layout is the same with `--use-distributed-optimizer` (tasks/train/zero.py): the sharded masters and Adam
moments are gathered into the full per-parameter state on DP rank 0 before it writes, and each rank takes its shard
on load, so a checkpoint saved at one DP size, with or without the flag, loads at any other.

`PolicyTrainer.save`/`load` call these. Copying a finished directory to the object store and back (so a run
resumes elsewhere) is storage/checkpoints.py's job; this module never touches the store.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch

from sluiceway.storage.digests import file_digests
from sluiceway.tasks.train.zero import restore_optimizer


class Checkpointed(Protocol):
    """What a checkpoint saves and restores of a trainer (tasks/train/trainer.py: `PolicyTrainer`)."""

    tp_rank: int
    tp_size: int
    dp_rank: int
    weight_version: int
    trainable: torch.nn.Module  # its parameters are `param_names`, in order
    param_names: list[str]
    zero: Any  # tasks/train/zero.py: ShardedAdamW with --use-distributed-optimizer, else None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    rounding: Any  # tasks/train/weight_rounding.py: MasterRounding in bf16, else None
    critic: Any  # tasks/train/critic.py: Critic for advantage_estimator ppo, else None

    def master_state_dict(self) -> dict[str, torch.Tensor]: ...


def save_checkpoint(trainer: Checkpointed, path: str | Path, step: int) -> None:
    """Checkpoint directory: per TP rank the model shard, optimizer, LR schedule, RNG states; a meta.json.

    A collective (every rank calls it). DP replicas hold the same state, so only DP rank 0 writes (with the
    distributed optimizer every DP rank first sends it its shards). The new directory is complete before it
    replaces the old one, so a crash mid-save leaves the previous checkpoint.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    sharded = trainer.zero is not None
    if trainer.dp_rank == 0 or sharded:  # sharded: the gathers below are collectives over DP
        state = {
            "model": trainer.master_state_dict(),
            "optimizer": trainer.zero.state_dict() if sharded else trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "weight_version": trainer.weight_version,
            "step": step,
            "critic": None if trainer.critic is None else trainer.critic.state_dict(),
        }
    if trainer.dp_rank == 0:
        tmp.mkdir(parents=True, exist_ok=True)
        torch.save(state, tmp / f"tp{trainer.tp_rank}.pt")
    _barrier()
    if torch.distributed.get_rank() == 0:
        meta = {"step": step, "weight_version": trainer.weight_version, "tensor_parallel": trainer.tp_size}
        meta["files"] = file_digests(tmp)  # checked before a resume trusts it (storage/checkpoints.py)
        (tmp / "meta.json").write_text(json.dumps(meta))
        old = path.with_name(path.name + ".old")
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        if old.exists():
            shutil.rmtree(old)
    _barrier()


def load_checkpoint(trainer: Checkpointed, path: str | Path) -> int:
    """Restore a checkpoint written by `save_checkpoint` with the same tensor-parallel size (any DP size, with or
    without the distributed optimizer); returns its step."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta["tensor_parallel"] != trainer.tp_size:
        raise RuntimeError(
            f"{path}: checkpoint was written with tensor_model_parallel_size={meta['tensor_parallel']}, "
            f"this trainer has {trainer.tp_size}"
        )
    state = torch.load(path / f"tp{trainer.tp_rank}.pt", map_location="cpu", weights_only=False)
    missing, unexpected = trainer.trainable.load_state_dict(state["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(
            f"{path}: checkpoint does not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    restore_optimizer(trainer, [state["model"][n] for n in trainer.param_names], state["optimizer"])
    if trainer.rounding is not None:  # the bf16 model as the run had it: its masters rounded the run's way
        params = [p for _, p in trainer.trainable.named_parameters()]
        trainer.rounding.copy(params, [state["model"][n] for n in trainer.param_names])
    trainer.scheduler.load_state_dict(state["scheduler"])
    if trainer.critic is not None:
        if state.get("critic") is None:
            raise RuntimeError(f"{path}: checkpoint has no critic (advantage_estimator ppo needs one)")
        trainer.critic.load_state_dict(state["critic"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    trainer.weight_version = state["weight_version"]
    return state["step"]


def _barrier() -> None:
    if torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()
