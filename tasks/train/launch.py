"""From the run config to a trainer: in the flow's own process, a torchrun group driven over a socket, or rank
actors on a Ray cluster (--ray-address)."""

from __future__ import annotations

from pathlib import Path

import torch

from sluiceway.flows.config import RunConfig
from sluiceway.tasks.train.remote import RemoteTrainer
from sluiceway.tasks.train.trainer import PolicyTrainer


def uses_torchrun(cfg: RunConfig) -> bool:
    res = cfg.resources
    return res.trainer_launcher == "torchrun" or (res.trainer_launcher == "auto" and res.actor_num_gpus_per_node > 1)


def build_trainer(
    cfg: RunConfig,
    hf_dir: str | Path,
    pad_token_id: int,
    work_dir: str | Path,
    total_iters: int,
    temperature: float | None = None,
) -> PolicyTrainer | RemoteTrainer:
    """The run's trainer; both kinds have the same methods (train_rollout, train_sft, save, load, write_weights)."""
    kwargs = dict(
        hf_dir=str(hf_dir),
        training=cfg.training,
        algorithm=cfg.algorithm,
        temperature=cfg.rollout.rollout_temperature if temperature is None else temperature,
        pad_token_id=pad_token_id,
        device=cfg.resources.device,
        total_iters=total_iters,
        max_response_len=cfg.rollout.rollout_max_response_len,
        tensor_parallel=cfg.resources.tensor_model_parallel_size,
    )
    res = cfg.resources
    if res.ray_address is None and not uses_torchrun(cfg):
        return PolicyTrainer(**kwargs)
    kwargs |= {"training": cfg.training.model_dump(), "algorithm": cfg.algorithm.model_dump()}
    if res.ray_address is not None:  # rank actors on the cluster (tasks/train/ray_group.py)
        from sluiceway.tasks.train.ray_group import RayTrainer, connect

        connect(res.ray_address)
        threads = res.num_threads or 1
        return RayTrainer(kwargs, res.actor_num_nodes, res.actor_num_gpus_per_node, threads, res.device)
    nproc = cfg.resources.actor_num_gpus_per_node
    # Share the machine's cores among the ranks (the flow process itself mostly waits while they train).
    threads = max(1, (cfg.resources.num_threads or torch.get_num_threads()) // nproc)
    return RemoteTrainer(kwargs, nproc=nproc, work_dir=work_dir, threads_per_proc=threads)
