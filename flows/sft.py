"""`sluiceway sft`: supervised fine-tuning from a dataset table, as a Prefect flow.

    (preflight: import the file into a dataset table, tokenize every sample)
    per step: train -> metrics -> checkpoint every save_interval and after the last;  at the end: publish the weights

Steps walk the data set epoch by epoch, each epoch in its own seeded order, global_batch_size samples a step
(the last one may be short): ceil(samples x num_epoch / global_batch_size) steps. The order depends only on the
seed, so a resumed run trains the same batches a straight one would have. Stages are tasks, not subflows
(docs/design.md); like the RL flow they find the live trainer by run id and return small dicts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from sluiceway.flows.config import RunConfig
from sluiceway.flows.live_run import LiveRun, live, open_run
from sluiceway.flows.precision import resolve_precision
from sluiceway.flows.scaffold import (
    TrainingRun,
    build_run_trainer,
    check_device,
    checkpoint_due,
    checkpoint_task,
    close_trainer,
    make_run_dir,
    open_store,
    publish_task,
)
from sluiceway.infra.errors import UserError
from sluiceway.models.zoo import load_tokenizer, resolve_checkpoint
from sluiceway.storage.checkpoints import load_checkpoint
from sluiceway.storage.datasets import import_prompts, load_prompts
from sluiceway.storage.metrics import append_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.tasks.rollout.prompts import dataset_table_name
from sluiceway.tasks.sync.disk import settle_versions
from sluiceway.tasks.train.remote import RemoteTrainer
from sluiceway.tasks.train.samples import TrainSample
from sluiceway.tasks.train.sft_data import SftSettings, sft_samples
from sluiceway.tasks.train.trainer import PolicyTrainer

log = logging.getLogger("sluiceway")


@dataclass
class SftPrepared:
    """Everything a user's input can be wrong about, checked before the flow starts."""

    store: ObjectStore
    hf_dir: Path
    tokenizer: object
    samples: list[TrainSample]
    table: str  # the dataset table the samples came from


def prepare_sft(cfg: RunConfig) -> SftPrepared:
    if cfg.algorithm.loss_type != "sft_loss":
        raise UserError("the SFT flow needs algorithm.loss_type sft_loss (`sluiceway sft` sets it)")
    check_device(cfg)
    d = cfg.data
    store = open_store(cfg)
    # One table per file and key choice: the same file read with other keys is other data.
    keys = hashlib.sha256(json.dumps([d.input_key, d.response_key, d.metadata_key]).encode()).hexdigest()[:8]
    table = f"{dataset_table_name(d.prompt_data, 0, cfg.training.seed)}-sft-{keys}"
    import_prompts(d.prompt_data, store, table, d.input_key, d.response_key, d.metadata_key)
    rows = load_prompts(store, table)
    hf_dir = resolve_checkpoint(cfg.training.hf_checkpoint)
    tokenizer = load_tokenizer(hf_dir)
    settings = SftSettings(d.apply_chat_template, d.system_prompt, d.sft_max_len, d.sft_truncate)
    samples = sft_samples(rows, tokenizer, settings, _where(d.prompt_data), has_response=d.response_key is not None)
    return SftPrepared(store, hf_dir, tokenizer, samples, table)


def _where(path: str):
    """Names a row as the import does: file:line for JSONL, 'file: row N' for Parquet."""
    parquet = path.lower().endswith(".parquet")
    return lambda row: f"{path}: row {row['row_index']}" if parquet else f"{path}:{row['prompt_id'].rsplit(':', 1)[1]}"


def num_steps(n_samples: int, cfg: RunConfig) -> int:
    return math.ceil(n_samples * (cfg.training.num_epoch or 1) / cfg.training.global_batch_size)


def batch_indices(n_samples: int, step: int, cfg: RunConfig) -> list[int]:
    """Sample indices of `step`: positions k of the epoch-by-epoch stream, each epoch shuffled by its seed."""
    t = cfg.training
    end = min((step + 1) * t.global_batch_size, n_samples * (t.num_epoch or 1))
    out, orders = [], {}
    for k in range(step * t.global_batch_size, end):
        epoch = k // n_samples
        if epoch not in orders:
            orders[epoch] = list(range(n_samples))
            random.Random(t.seed * 1_000_003 + epoch).shuffle(orders[epoch])
        out.append(orders[epoch][k % n_samples])
    return out


@dataclass
class SftRun(TrainingRun):
    cfg: RunConfig
    run_dir: Path
    prep: SftPrepared
    trainer: PolicyTrainer | RemoteTrainer
    total_steps: int

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoints" / "latest"

    @classmethod
    def create(cls, cfg: RunConfig, live_run: LiveRun) -> SftRun:
        prep = live_run.take_prepared(prepare_sft)
        run_dir = make_run_dir(cfg)
        total = num_steps(len(prep.samples), cfg)
        # Log-probs at temperature 1: SFT fits the model's own distribution, not a sampling temperature.
        trainer = build_run_trainer(cfg, prep.hf_dir, prep.tokenizer, run_dir, total, temperature=1.0)
        return cls(cfg, run_dir, prep, trainer, total)

    def resume(self) -> int:
        """Load the latest checkpoint, if any; return the first step still to train."""
        step = load_checkpoint(self.trainer, self.checkpoint_path)
        # The final publish keeps a version directory it finds: checked, rebuilt if damaged (tasks/sync/disk.py).
        settle_versions(self.run_dir / "weights", self.trainer.weight_version)
        if step is None:
            return 0
        log.info("resumed from %s (step %d)", self.checkpoint_path, step)
        return step + 1


@task(name="sft-train", cache_policy=NO_CACHE, persist_result=False)
def sft_train_task(run_id: str, step: int) -> dict:
    run = live(run_id, SftRun)
    idx = batch_indices(len(run.prep.samples), step, run.cfg)
    m = {f"train/{k}": v for k, v in run.trainer.train_sft([run.prep.samples[i] for i in idx], step).items()}
    m["train/samples"] = float(len(idx))
    m["epoch"] = step * run.cfg.training.global_batch_size / len(run.prep.samples)
    m["weight_version"] = float(run.trainer.weight_version)
    return m


def format_step(step: int, total: int, m: dict) -> str:
    return (
        f"sft step {step + 1:>4}/{total}  loss {m['train/loss']:.4f}  tokens {int(m['train/tokens'])}"
        f"  grad {m['train/grad_norm']:.3f}  lr {m['train/lr']:.2e}  {m['train/tokens_per_s']:.0f} tok/s"
        f"  {m['time/step_s']:.1f}s"
    )


@flow(name="sluiceway-sft", log_prints=False)
def sft_flow(config: RunConfig) -> dict:
    """Fine-tune on `config`'s data file from its last checkpoint to the end (typed so the UI shows a form)."""
    cfg = resolve_precision(RunConfig.model_validate(config))  # auto -> bf16/fp32 (a UI run starts here)
    # The CLI opened the run already (flows/live_run.py); a deployment's run opens it here.
    with open_run(cfg, "sft") as live_run, live_run.serving(SftRun.create(cfg, live_run), _close) as run:
        prep, trained = run.prep, 0
        start, total = run.resume(), run.total_steps
        interval = cfg.training.save_interval
        for step in range(start, total):
            t0 = time.perf_counter()
            m = sft_train_task(cfg.run_id, step)
            m["time/step_s"] = time.perf_counter() - t0
            append_metrics(prep.store, cfg.run_id, step, m, tag="sft")
            if checkpoint_due(interval, step, total):  # after the metrics: flows/scaffold.py says why
                checkpoint_task(cfg.run_id, step)
            trained += 1
            if not cfg.logging.quiet:
                print(format_step(step, total, m), flush=True)
        weights = publish_task(cfg.run_id)
    return {
        "run_id": cfg.run_id,
        "steps": trained,
        "total_steps": total,
        "samples": len(prep.samples),
        "weights": weights,
        "tables": cfg.tables_uri,
        "final_weight_version": run.trainer.weight_version,
    }


def _close(run: SftRun) -> None:
    close_trainer(run.trainer)
