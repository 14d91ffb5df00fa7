"""What a run holds in memory between stages: store, tokenizer, prompts, engines, trainer, reward settings.

Prefect task parameters must stay small and JSON-able (docs/design.md), so tasks receive (run_id, step) and
find the live objects with `get` (flows/live_run.py). Everything durable -- data, trajectories, rewards, metrics,
checkpoints -- is in the tables or the run directory, which is what a restarted run resumes from.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sluiceway.flows.config import RunConfig
from sluiceway.flows.console import ProgressLine
from sluiceway.flows.engines import RolloutEngines
from sluiceway.flows.live_run import LiveRun, live
from sluiceway.flows.opd import TeacherEngine, has_teacher_engine
from sluiceway.flows.scaffold import build_run_trainer, check_device, close_trainer, make_run_dir, open_store
from sluiceway.flows.slime.flag_table import slime_flag_switches
from sluiceway.infra.errors import UserError
from sluiceway.infra.sglang_launcher import require_sglang
from sluiceway.models.zoo import load_tokenizer, resolve_checkpoint
from sluiceway.storage.checkpoints import fetch_newer_checkpoint, load_checkpoint, save_checkpoint
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.weights.publish import WeightPublisher
from sluiceway.tasks.environments.adaptive_source import AdaptivePromptSource
from sluiceway.tasks.filter.filters import scoring_filter, user_filter
from sluiceway.tasks.reward.score import RewardSettings
from sluiceway.tasks.reward.settings import build_reward_settings
from sluiceway.tasks.rollout.prompts import build_rollout_settings, load_dataset, load_eval_prompts, render_items
from sluiceway.tasks.rollout.rollout import PromptItem, RolloutSettings
from sluiceway.tasks.rollout.slime_plugins.args import slime_args
from sluiceway.tasks.sync.disk import settle_versions
from sluiceway.tasks.sync.publish import sync_due, sync_weights, weight_publisher
from sluiceway.tasks.train.remote import RemoteTrainer
from sluiceway.tasks.train.trainer import PolicyTrainer

log = logging.getLogger("sluiceway")


@dataclass
class Prepared:
    """The cheap half of a run's set-up: everything a user's input can be wrong about, checked up front."""

    store: ObjectStore
    hf_dir: Path
    tokenizer: object
    prompts: list[PromptItem]
    rewards: RewardSettings
    settings: RolloutSettings
    eval_prompts: dict[str, list[PromptItem]]  # evaluation set name -> prompts
    rollout_filter: Callable | None  # dynamic sampling: scores a finished group and may drop it
    adaptive: AdaptivePromptSource | None  # prompts generated per step at adaptive difficulty
    slime_args: argparse.Namespace  # the one `args` slime-style plugins get (tasks/rollout/slime_plugins/args.py)


def prepare(cfg: RunConfig) -> Prepared:
    if cfg.rollout.rollout_engine == "sglang":
        require_sglang()
    check_device(cfg)
    store = open_store(cfg)
    hf_dir = resolve_checkpoint(cfg.training.hf_checkpoint)
    slime = slime_args(cfg, hf_dir, slime_flag_switches())
    reward_settings = build_reward_settings(cfg, slime)
    rows = load_dataset(cfg, store, cfg.data.prompt_data, cfg.data.env_size, cfg.training.seed)
    if len(rows) == 0:
        raise UserError(f"--prompt-data {cfg.data.prompt_data}: no prompts")
    rollout_filter = None
    if (path := cfg.rollout.dynamic_sampling_filter_path) is not None:
        dynamic = user_filter(path, cfg.rollout.plugin_convention, slime)
        rollout_filter = scoring_filter(reward_settings, [dynamic])
    tokenizer = load_tokenizer(hf_dir)
    prompts = render_items(cfg, tokenizer, rows)
    eval_prompts = load_eval_prompts(cfg, store, tokenizer) if cfg.eval.eval_interval else {}
    settings = build_rollout_settings(cfg, tokenizer, hf_dir, slime)
    adaptive = None
    if cfg.data.adaptive_difficulty:
        d = cfg.data
        run_dir = Path(cfg.storage.output_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        adaptive = AdaptivePromptSource(
            d.prompt_data,
            run_dir / "curriculum.json",
            cfg.training.seed,
            raise_above=d.difficulty_raise_above,
            lower_below=d.difficulty_lower_below,
            window=d.difficulty_window,
            min_samples=d.difficulty_min_samples,
        )
    return Prepared(
        store, hf_dir, tokenizer, prompts, reward_settings, settings, eval_prompts, rollout_filter, adaptive, slime
    )


@dataclass
class Runtime:
    cfg: RunConfig
    run_dir: Path
    prep: Prepared
    engines: RolloutEngines
    trainer: PolicyTrainer | RemoteTrainer
    console: ProgressLine = field(default_factory=ProgressLine)
    _publisher: WeightPublisher | None = field(default=None, repr=False)  # update_weight_mode delta
    teacher: TeacherEngine | None = None  # use_opd with opd_type sglang: the engine that scores each sample

    # Shortcuts used by the stages.
    store = property(lambda self: self.prep.store)
    prompts = property(lambda self: self.prep.prompts)
    rewards = property(lambda self: self.prep.rewards)
    settings = property(lambda self: self.prep.settings)

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoints" / "latest"

    @classmethod
    def create(cls, cfg: RunConfig, live_run: LiveRun) -> Runtime:
        """The run's engines and trainer, from the inputs the CLI's preflight checked (else checked here) and the
        engines it started early (else started here)."""
        prep = live_run.take_prepared(prepare)
        run_dir = make_run_dir(cfg)
        total_iters = cfg.rollout.num_rollout * cfg.training.num_steps_per_rollout
        # Embedded engines load their model while the trainer builds (separate processes: on a CPU machine the
        # two start-ups share the cores instead of queueing). SGLang sizes its KV cache from the GPU memory free
        # when it starts, so it starts after the trainer holds its share.
        embedded = cfg.rollout.rollout_engine == "embedded"
        early = live_run.take_early_engines()
        if early is None and embedded:
            early = RolloutEngines(cfg, prep.hf_dir, run_dir, wait=False)
        teacher = None
        try:
            if has_teacher_engine(cfg):  # OPD's teacher engine (if the run starts one) loads beside the others
                teacher = TeacherEngine(cfg, run_dir)
            trainer = build_run_trainer(cfg, prep.hf_dir, prep.tokenizer, run_dir, total_iters)
        except BaseException:
            for started in (early, teacher):
                if started is not None:
                    started.close()
            raise
        try:
            engines = early.wait_ready() if early is not None else RolloutEngines(cfg, prep.hf_dir, run_dir)
            if teacher is not None:
                teacher.wait_ready(engines.loop)
        except BaseException:
            close_trainer(trainer)
            if teacher is not None:
                teacher.close()
            raise
        rt = cls(cfg, run_dir, prep, engines, trainer, ProgressLine(enabled=not cfg.logging.quiet))
        rt.teacher = teacher
        return rt

    def close(self) -> None:
        try:
            if self.teacher is not None:
                self.teacher.close()
        finally:
            self.prep.settings.close()
            self.engines.close()
            close_trainer(self.trainer)

    def _weight_publisher(self) -> WeightPublisher:
        if self._publisher is None:  # one per process: it holds the last version in memory to diff against
            self._publisher = weight_publisher(self.cfg)
        return self._publisher

    def sync_weights(self, step: int | None = None) -> Path | None:
        """Publish the trainer's current weights as a model directory and load it on every engine.

        After rollout ``step`` this skips (None) unless update_weights_interval says to sync; with
        update_weight_mode delta the version also goes to the weight store, where remote pools pull it
        (tasks/sync/publish.py).
        """
        if step is not None and not sync_due(self.cfg, step):
            return None
        weights_dir = self.run_dir / "weights"
        return sync_weights(self.cfg, self.trainer, self.engines, self.prep.hf_dir, weights_dir, self._weight_publisher)

    def decode(self, ids: list[int]) -> str:
        return self.prep.tokenizer.decode(ids, skip_special_tokens=True)

    def save_checkpoint(self, step: int) -> str:
        """Checkpoint the trainer after `step`; with a storage_uri the checkpoint also goes to the object store."""
        store = self.store if self.cfg.storage.storage_uri else None
        return save_checkpoint(self.trainer, self.checkpoint_path, step, store, self.cfg.run_id)

    def resume(self) -> int:
        """Load the latest checkpoint, if any; return the first step still to train."""
        if self.cfg.storage.storage_uri:  # a run resumed elsewhere takes the object store's newer checkpoint
            fetch_newer_checkpoint(self.store, self.cfg.run_id, self.checkpoint_path)
        step = load_checkpoint(self.trainer, self.checkpoint_path)
        # The engines are about to load this version's directory: checked, rebuilt if damaged (tasks/sync/disk.py).
        settle_versions(self.run_dir / "weights", self.trainer.weight_version)
        if step is None:
            return 0
        self.sync_weights()
        log.info(
            "resumed from %s (step %d, weight version %d)", self.checkpoint_path, step, self.trainer.weight_version
        )
        return step + 1


def get(run_id: str) -> Runtime:
    """The RL flow's live runtime (flows/live_run.py)."""
    return live(run_id, Runtime)
