"""What every flow (rl, sft, eval, replay) sets up the same way: the device check, the run's store and directory,
the trainer, and the checkpoint and publish tasks of the flows that only train (sft, replay). Where the flows'
tasks find their run: flows/live_run.py."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from sluiceway.flows.config import RunConfig
from sluiceway.flows.live_run import live
from sluiceway.infra.errors import UserError
from sluiceway.storage.object_store import ObjectStore

if TYPE_CHECKING:  # `sluiceway eval` uses this module but never trains: the trainer's imports (megatron) wait
    from sluiceway.tasks.train.remote import RemoteTrainer
    from sluiceway.tasks.train.trainer import PolicyTrainer


def check_device(cfg: RunConfig) -> None:
    """The configured device exists, and torch uses the configured number of threads."""
    if cfg.resources.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available (use --device cpu)")
    if cfg.resources.num_threads:
        torch.set_num_threads(cfg.resources.num_threads)


def open_store(cfg: RunConfig, uri: str | None = None) -> ObjectStore:
    """The run's tables (or another root `uri`) with the run's S3 settings."""
    return ObjectStore.from_uri(uri or cfg.tables_uri, cfg.storage.s3_endpoint_url, cfg.storage.s3_region)


def make_run_dir(cfg: RunConfig) -> Path:
    run_dir = Path(cfg.storage.output_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def build_run_trainer(
    cfg: RunConfig, hf_dir: Path, tokenizer, run_dir: Path, total_iters: int, **kw
) -> PolicyTrainer | RemoteTrainer:
    """The run's trainer under `run_dir/trainer`, padding with the tokenizer's pad token (else its EOS)."""
    from sluiceway.tasks.train.launch import build_trainer

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return build_trainer(cfg, hf_dir, pad, run_dir / "trainer", total_iters, **kw)


def close_trainer(trainer: PolicyTrainer | RemoteTrainer) -> None:
    if hasattr(trainer, "close"):  # a torchrun group or Ray actors; an in-process trainer goes with the process
        trainer.close()


class TrainingRun:
    """The live run of a flow that only trains (sft, replay): it has `trainer`, `checkpoint_path`, `run_dir` and
    `prep.hf_dir`, which is all the checkpoint and publish tasks use."""

    trainer: PolicyTrainer | RemoteTrainer
    checkpoint_path: Path
    run_dir: Path


def checkpoint_due(save_interval: int | None, step: int, total: int) -> bool:
    """After `step` (0-based) of `total`: every `save_interval` steps, and always after the last one.

    The flows save a step's checkpoint after its metrics (and evaluation) are stored: a checkpoint is the
    point a resume starts after, so everything the step logs must be durable before it (a kill in between
    retrains the step, bit-identically, and the idempotent metric appends skip what was stored).
    """
    return step + 1 == total or bool(save_interval) and (step + 1) % save_interval == 0


@task(name="checkpoint", cache_policy=NO_CACHE, persist_result=False)
def checkpoint_task(run_id: str, step: int) -> str:
    run = live(run_id, TrainingRun)
    run.trainer.save(run.checkpoint_path, step)
    return str(run.checkpoint_path)


@task(name="publish", cache_policy=NO_CACHE, persist_result=False)
def publish_task(run_id: str) -> str:
    """The trained weights as an HF model directory (weights/vNNNNNN), loadable by transformers or an engine."""
    run = live(run_id, TrainingRun)
    return str(run.trainer.write_weights(run.prep.hf_dir, run.run_dir / "weights"))
