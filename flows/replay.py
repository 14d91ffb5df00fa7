"""`sluiceway replay`: train again on a stored run's trajectories, with no engine running, as a Prefect flow.

    (preflight: pin the trajectories table version, check the run and its steps)
    per stored step: train -> metrics (tag "replay") -> checkpoint every save_interval;  at the end: publish

The table is read at one Delta version (`--replay-version`, or `--replay-timestamp` through time travel, else the
latest when the replay starts), one step at a time, in the stored order or `--replay-steps`'. Advantages are
computed again from the stored rewards with the configured estimator, so an ablation of the estimator or the
loss needs no new rollouts.

Off-policy correction: the stored rollout log-probs are the behaviour policy. Replay uses the trainer's truncated
importance sampling against them (`--use-tis`, which `sluiceway replay` turns on unless the YAML or a flag says
otherwise): each token's loss is weighted by clamp(pi_current / pi_behaviour, tis_clip_low, tis_clip), where
pi_current is the trainer's policy before the step's first optimizer step, while PPO's clip acts between that and
the policy being updated. Using the stored log-probs as PPO's old log-probs instead would clip, and so drop from
the gradient, every token on which the current policy has moved more than eps_clip from the stored one (most of
them, once the policies differ by a few steps), with no bound on the weights of the rest; TIS keeps PPO's trust
region around the current policy and makes the ratio to the behaviour policy explicit and truncated. The stored
log-probs were taken at the stored run's sampling temperature: give the same `--rollout-temperature`.

The flow imports nothing from the engine side (flows/engines.py, infra/); its checkpoint lives in
`checkpoints/replay`, and `replay.json` in the run directory pins the source, so a resumed replay reads the
same table version and continues after its last checkpointed step.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from sluiceway.flows.config import ReplayRunConfig, RunConfig, validate_for
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
from sluiceway.storage.metrics import append_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.tasks.sync.disk import settle_versions
from sluiceway.tasks.train.remote import RemoteTrainer
from sluiceway.tasks.train.replay import ReplaySource, open_source, step_batch
from sluiceway.tasks.train.trainer import PolicyTrainer

log = logging.getLogger("sluiceway")


@dataclass
class ReplayPrepared:
    source: ReplaySource
    tables: str  # where the source table lives
    store: ObjectStore  # this run's tables (metrics)
    hf_dir: Path
    tokenizer: object


def _manifest_path(cfg: RunConfig) -> Path:
    return Path(cfg.storage.output_dir).resolve() / "replay.json"


def prepare_replay(cfg: RunConfig) -> ReplayPrepared:
    """Everything a user can get wrong, checked before the flow starts; no model is built here."""
    check_device(cfg)
    rp = cfg.replay
    tables = rp.replay_tables or cfg.tables_uri
    if "://" not in tables and not Path(tables).is_dir():  # ObjectStore would create a missing local directory
        raise UserError(f"--replay-tables {tables}: no such directory")
    source_store = open_store(cfg, tables)
    store = open_store(cfg)
    if rp.replay_run_id == cfg.run_id and source_store.table_uri("x") == store.table_uri("x"):
        raise UserError(
            f"replay: run id {cfg.run_id} is the stored run itself; give the replay its own --output-dir or --run-id"
        )
    pinned = _read_manifest(cfg)
    version = rp.replay_version
    if pinned and version is None and rp.replay_timestamp is None:
        version = pinned["version"]  # a resumed replay keeps the version it started from
    source = open_source(source_store, rp.replay_run_id, version, rp.replay_timestamp, rp.replay_steps)
    mine = {"tables": tables, "run_id": source.run_id, "version": source.version, "steps": source.steps}
    if pinned and pinned != mine:
        raise UserError(
            f"{_manifest_path(cfg)}: this run directory replays {pinned}, not {mine}; use a new --output-dir"
        )
    hf_dir = resolve_checkpoint(cfg.training.hf_checkpoint)
    return ReplayPrepared(source, tables, store, hf_dir, load_tokenizer(hf_dir))


def _read_manifest(cfg: RunConfig) -> dict | None:
    p = _manifest_path(cfg)
    return json.loads(p.read_text()) if p.exists() else None


@dataclass
class ReplayRun(TrainingRun):
    cfg: RunConfig
    run_dir: Path
    prep: ReplayPrepared
    trainer: PolicyTrainer | RemoteTrainer

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoints" / "replay"  # apart from an RL run's checkpoints/latest

    @classmethod
    def create(cls, cfg: RunConfig, live_run: LiveRun) -> ReplayRun:
        prep = live_run.take_prepared(prepare_replay)
        run_dir = make_run_dir(cfg)
        s = prep.source
        manifest = {"tables": prep.tables, "run_id": s.run_id, "version": s.version, "steps": s.steps}
        _manifest_path(cfg).write_text(json.dumps(manifest))
        total_iters = len(s.steps) * cfg.training.num_steps_per_rollout
        trainer = build_run_trainer(cfg, prep.hf_dir, prep.tokenizer, run_dir, total_iters)
        return cls(cfg, run_dir, prep, trainer)

    def resume(self) -> int:
        """Load the replay's checkpoint, if any; return the position in the step list to continue from."""
        step = load_checkpoint(self.trainer, self.checkpoint_path)
        # The final publish keeps a version directory it finds: checked, rebuilt if damaged (tasks/sync/disk.py).
        settle_versions(self.run_dir / "weights", self.trainer.weight_version)
        if step is None:
            return 0
        log.info("resumed from %s (stored step %d)", self.checkpoint_path, step)
        return self.prep.source.steps.index(step) + 1


@task(name="replay-train", cache_policy=NO_CACHE, persist_result=False)
def replay_train_task(run_id: str, step: int) -> dict:
    run = live(run_id, ReplayRun)
    a = run.cfg.algorithm
    samples, metrics = step_batch(run.prep.source, step, a.advantage_estimator, a.normalize_advantages_by_std)
    metrics.update({k if "/" in k else f"train/{k}": v for k, v in run.trainer.train_rollout(samples, step).items()})
    metrics["weight_version"] = float(run.trainer.weight_version)
    metrics["replay/table_version"] = float(run.prep.source.version)
    return metrics


def format_step(step: int, i: int, total: int, m: dict) -> str:
    nan = float("nan")
    return (
        f"replay step {step:>3} ({i + 1}/{total})  reward {m['reward_mean']:.3f}  samples {int(m['samples'])}"
        f"  loss {m.get('train/loss', nan):+.4f}  grad {m.get('train/grad_norm', nan):.3f}"
        f"  |dlogp| {m.get('train/logprob_mismatch', nan):.3f}  v{int(m['weight_version'])}  {m['time/step_s']:.1f}s"
    )


@flow(name="sluiceway-replay", log_prints=False)
def replay_flow(config: ReplayRunConfig) -> dict:
    """Train on the stored trajectories `config.replay` names, from the last checkpoint (typed: the UI's form)."""
    cfg = resolve_precision(validate_for(config, "replay"))  # auto -> bf16/fp32 (a UI run starts here)
    # The CLI opened the run already (flows/live_run.py); a deployment's run opens it here.
    with open_run(cfg, "replay") as live_run:
        if not cfg.algorithm.use_tis:
            log.warning("replay without use_tis: the stored samples are trained as if the current policy made them")
        with live_run.serving(ReplayRun.create(cfg, live_run), _close) as run:
            prep = run.prep
            steps, trained = prep.source.steps, 0
            start, interval = run.resume(), cfg.training.save_interval
            for i in range(start, len(steps)):
                t0 = time.perf_counter()
                m = replay_train_task(cfg.run_id, steps[i])
                m["time/step_s"] = time.perf_counter() - t0
                append_metrics(prep.store, cfg.run_id, steps[i], m, tag="replay")
                if checkpoint_due(interval, i, len(steps)):  # after the metrics: flows/scaffold.py says why
                    checkpoint_task(cfg.run_id, steps[i])
                trained += 1
                if not cfg.logging.quiet:
                    print(format_step(steps[i], i, len(steps), m), flush=True)
            weights = publish_task(cfg.run_id)
    return {
        "run_id": cfg.run_id,
        "steps": trained,
        "total_steps": len(steps),
        "source": f"{prep.source.run_id} @ {prep.tables} v{prep.source.version}",
        "weights": weights,
        "tables": cfg.tables_uri,
        "final_weight_version": run.trainer.weight_version,
    }


def _close(run: ReplayRun) -> None:
    close_trainer(run.trainer)
