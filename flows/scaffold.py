"""What every flow (rl, sft, eval, replay) sets up the same way: the per-process registry its tasks find the run
in, the device check, the run's store and directory, the trainer, and the checkpoint and publish tasks of the
flows that only train (sft, replay).

Prefect task parameters must stay small and JSON-able (docs/design.md), so tasks receive (run_id, step) and
find the live objects in a `Registry`; the CLI's preflight hands its prepared inputs to the flow there too, so
they are not made twice in one process (a deployment's worker makes its own).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Generic, TypeVar

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from sluiceway.flows.config import RunConfig
from sluiceway.infra.errors import UserError
from sluiceway.storage import run_lock
from sluiceway.storage.object_store import ObjectStore
from sluiceway.tasks.train.launch import build_trainer
from sluiceway.tasks.train.remote import RemoteTrainer
from sluiceway.tasks.train.trainer import PolicyTrainer

P = TypeVar("P")  # a flow's prepared inputs
R = TypeVar("R")  # a flow's live run


class Registry(Generic[P, R]):
    """Per process, by run id: the preflight's prepared inputs waiting for the flow, and the live run."""

    def __init__(self, what: str):
        self.what = what  # names the run in the error of a task that finds none
        self._prepared: dict[str, P] = {}
        self._runs: dict[str, R] = {}

    def hand_over(self, run_id: str, prep: P) -> None:
        self._prepared[run_id] = prep

    def take_prepared(self, run_id: str) -> P | None:
        """The preflight's work for this run, if this process made it (a deployment's worker did not)."""
        return self._prepared.pop(run_id, None)

    def register(self, run_id: str, run: R) -> None:
        self._runs[run_id] = run

    def unregister(self, run_id: str) -> R | None:
        return self._runs.pop(run_id, None)

    def get(self, run_id: str) -> R:
        """The live run; every stage gets it before it writes, so a run that lost its lease stops here."""
        run_lock.ensure_held(run_id)
        try:
            return self._runs[run_id]
        except KeyError:
            raise RuntimeError(f"run {run_id} has no live {self.what} in this process") from None


def check_device(cfg: RunConfig) -> None:
    """The configured device exists, and torch uses the configured number of threads."""
    if cfg.resources.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available (use --device cpu)")
    if cfg.resources.num_threads:
        torch.set_num_threads(cfg.resources.num_threads)


def open_store(cfg: RunConfig, uri: str | None = None) -> ObjectStore:
    """The run's tables (or another root `uri`) with the run's S3 settings."""
    return ObjectStore.from_uri(uri or cfg.tables_uri, cfg.storage.s3_endpoint_url, cfg.storage.s3_region)


@contextlib.contextmanager
def run_locked(cfg: RunConfig, command: str) -> Iterator[None]:
    """The run's lock (storage/run_lock.py) and the check of its tables (storage/integrity.py), for a flow started
    without the CLI (a deployment from the Prefect UI); when the CLI holds the lock already it has checked the
    tables too, and this only re-enters."""
    from sluiceway.storage.integrity import check_tables
    from sluiceway.storage.maintenance import RUN_TABLES

    taken_here, store = not run_lock.held(cfg.run_id), open_store(cfg)
    with run_lock.hold(Path(cfg.storage.output_dir).resolve(), store, cfg.run_id, command):
        if taken_here:
            check_tables(store, RUN_TABLES)
        yield


def make_run_dir(cfg: RunConfig) -> Path:
    run_dir = Path(cfg.storage.output_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def build_run_trainer(
    cfg: RunConfig, hf_dir: Path, tokenizer, run_dir: Path, total_iters: int, **kw
) -> PolicyTrainer | RemoteTrainer:
    """The run's trainer under `run_dir/trainer`, padding with the tokenizer's pad token (else its EOS)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return build_trainer(cfg, hf_dir, pad, run_dir / "trainer", total_iters, **kw)


def close_trainer(trainer: PolicyTrainer | RemoteTrainer) -> None:
    if hasattr(trainer, "close"):  # a torchrun group or Ray actors; an in-process trainer goes with the process
        trainer.close()


# The live runs of the flows that only train (sft, replay): each has `trainer`, `checkpoint_path`, `run_dir`
# and `prep.hf_dir`, which is all the checkpoint and publish tasks use.
TRAINING_RUNS: Registry = Registry("training run")


def checkpoint_due(save_interval: int | None, step: int, total: int) -> bool:
    """After `step` (0-based) of `total`: every `save_interval` steps, and always after the last one.

    The flows save a step's checkpoint after its metrics (and evaluation) are stored: a checkpoint is the
    point a resume starts after, so everything the step logs must be durable before it (a kill in between
    retrains the step, bit-identically, and the idempotent metric appends skip what was stored).
    """
    return step + 1 == total or bool(save_interval) and (step + 1) % save_interval == 0


@task(name="checkpoint", cache_policy=NO_CACHE, persist_result=False)
def checkpoint_task(run_id: str, step: int) -> str:
    run = TRAINING_RUNS.get(run_id)
    run.trainer.save(run.checkpoint_path, step)
    return str(run.checkpoint_path)


@task(name="publish", cache_policy=NO_CACHE, persist_result=False)
def publish_task(run_id: str) -> str:
    """The trained weights as an HF model directory (weights/vNNNNNN), loadable by transformers or an engine."""
    run = TRAINING_RUNS.get(run_id)
    return str(run.trainer.write_weights(run.prep.hf_dir, run.run_dir / "weights"))
