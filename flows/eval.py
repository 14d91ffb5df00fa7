"""`sluiceway eval`: evaluate a model on the eval sets with the rollout engines, no training, as a Prefect flow.

    (preflight: resolve the model, import and render the eval sets)
    start engines on the model -> one evaluate task per set -> metrics (tag "eval") -> stop engines

The model is a zoo name, an HF model directory, or a run's published weights: `OUTPUT_DIR/weights/vNNNNNN`, or
`OUTPUT_DIR/weights` for its newest version. The eval sets, seeds and scoring are those of the RL flow's evaluate
stage (tasks/evaluate/evaluate.py, the same prompts: seed + 1, first eval_size), so the numbers compare with a
run's own `eval after N steps`; --eval-temperature, --eval-top-p and --eval-max-response-len override the
rollout's sampling (temperature 0: greedy). Metrics, and every sample in the evals table (storage/evals.py), are
stored at the weights' version (0 for a model that is no run's weights) under this run's id.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from sluiceway.flows.config import EvalRunConfig, RunConfig, validate_for
from sluiceway.flows.engines import RolloutEngines
from sluiceway.flows.live_run import live, open_run
from sluiceway.flows.precision import resolve_precision
from sluiceway.flows.scaffold import make_run_dir, open_store
from sluiceway.flows.slime.flag_table import slime_flag_switches
from sluiceway.infra.errors import Fault, UserError
from sluiceway.infra.sglang_launcher import require_sglang
from sluiceway.models.zoo import load_tokenizer, resolve_checkpoint
from sluiceway.storage.metrics import append_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.weights.checksums import checksums_problem, version_problem
from sluiceway.tasks.evaluate.evaluate import evaluate
from sluiceway.tasks.reward.score import RewardSettings
from sluiceway.tasks.reward.settings import build_reward_settings
from sluiceway.tasks.rollout.prompts import build_rollout_settings, eval_rollout_settings, load_eval_prompts
from sluiceway.tasks.rollout.rollout import PromptItem, RolloutSettings
from sluiceway.tasks.rollout.slime_plugins.args import slime_args

_VERSION_DIR = re.compile(r"v(\d{6})")


@dataclass
class EvalPrepared:
    store: ObjectStore
    hf_dir: Path
    version: int  # the weights' version when they are a run's published weights, else 0
    tokenizer: object
    eval_prompts: dict[str, list[PromptItem]]
    rewards: RewardSettings
    settings: RolloutSettings


def resolve_model(name_or_dir: str) -> tuple[Path, int]:
    """The model directory and its weight version; a run's weights root means its newest version."""
    p = Path(name_or_dir).expanduser()
    if p.is_dir() and not (p / "config.json").exists():
        versions = sorted(d for d in p.iterdir() if _VERSION_DIR.fullmatch(d.name) and (d / "config.json").exists())
        if versions:
            p, name_or_dir = versions[-1], str(versions[-1])
    hf_dir = resolve_checkpoint(name_or_dir)
    m = _VERSION_DIR.fullmatch(hf_dir.name)
    return hf_dir, int(m.group(1)) if m else 0


def prepare_eval(cfg: RunConfig) -> EvalPrepared:
    if cfg.rollout.rollout_engine == "sglang":
        require_sglang()
    store = open_store(cfg)
    hf_dir, version = resolve_model(cfg.training.hf_checkpoint)
    slime = slime_args(cfg, hf_dir, slime_flag_switches())  # one `args` for slime-style generate and rm
    rewards = build_reward_settings(cfg, slime)
    # A run's published weights: checked once, before the engines load them, against the run's record of them.
    problem = version_problem(hf_dir, version) if _VERSION_DIR.fullmatch(hf_dir.name) else checksums_problem(hf_dir)
    if problem is not None:
        raise Fault(
            f"weights {hf_dir}/{problem}. Nothing was evaluated; restore the directory or evaluate another "
            f"version (a resume of the run that wrote it writes the version its checkpoint holds again)"
        )
    tokenizer = load_tokenizer(hf_dir)
    prompts = load_eval_prompts(cfg, store, tokenizer)
    empty = [name for name, items in prompts.items() if not items]
    if empty:
        raise UserError(f"--eval-prompt-data: set {empty[0]!r} has no prompts")
    settings = eval_rollout_settings(cfg, build_rollout_settings(cfg, tokenizer, hf_dir, slime))
    return EvalPrepared(store, hf_dir, version, tokenizer, prompts, rewards, settings)


@dataclass
class _EvalRun:
    cfg: RunConfig
    prep: EvalPrepared
    engines: RolloutEngines

    def decode(self, ids: list[int]) -> str:
        return self.prep.tokenizer.decode(ids, skip_special_tokens=True)

    def close(self) -> None:
        self.prep.settings.close()
        self.engines.close()


@task(name="evaluate", cache_policy=NO_CACHE, persist_result=False)
def eval_set_task(run_id: str, name: str) -> dict:
    run = live(run_id, _EvalRun)
    c, p = run.cfg, run.prep
    return run.engines.run(
        evaluate(
            client=run.engines.client,
            prompts=p.eval_prompts[name],
            settings=p.settings,
            reward_settings=p.rewards,
            n_samples=c.eval.n_samples_per_eval_prompt,
            tag=f"{run_id}/{p.version}/{name}",
            decode=run.decode,
            name=name,
            store=p.store,  # the samples go to the evals table
            run_id=run_id,
            step=p.version,
        )
    )


def format_set(name: str, m: dict[str, float]) -> str:
    prefix = f"eval/{name}/"
    scores = "  ".join(
        f"{k.removeprefix(prefix)} {v:.3f}" for k, v in m.items() if k.startswith(prefix) and not k.endswith("/prompts")
    )
    return f"eval {name}  {scores}  ({int(m[prefix + 'prompts'])} prompts)"


@flow(name="sluiceway-eval", log_prints=False)
def eval_flow(config: EvalRunConfig) -> dict:
    """Evaluate `config`'s hf_checkpoint on its eval sets (typed so the UI shows the config's form)."""
    cfg = resolve_precision(validate_for(config, "eval"))  # auto -> bf16/fp32 (a UI run starts here)
    # The CLI opened the run already (flows/live_run.py); a deployment's run opens it here.
    with open_run(cfg, "eval") as live_run:
        prep = live_run.take_prepared(prepare_eval)
        run_dir = make_run_dir(cfg)
        t0 = time.perf_counter()
        engines = RolloutEngines(cfg, prep.hf_dir, run_dir, weight_version=prep.version)
        metrics: dict[str, float] = {}
        with live_run.serving(_EvalRun(cfg, prep, engines), _EvalRun.close):
            for name in prep.eval_prompts:
                m = eval_set_task(cfg.run_id, name)
                metrics |= m
                if not cfg.logging.quiet:
                    print(format_set(name, m), flush=True)
        metrics["time/eval_s"] = time.perf_counter() - t0
        append_metrics(prep.store, cfg.run_id, prep.version, metrics, tag="eval")
    return {
        "run_id": cfg.run_id,
        "model": str(prep.hf_dir),
        "step": prep.version,
        "metrics": metrics,
        "tables": cfg.tables_uri,
    }
