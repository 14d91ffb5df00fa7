"""The RL loop as a Prefect flow: each stage of each step is a durable Prefect task.

    rollout -> reward -> filter -> train -> sync -> metrics (-> evaluate) (-> checkpoint every save_interval)

Stage logic lives in `sluiceway.tasks.*` as plain functions; the tasks here only fetch the live runtime and
return small summaries (counts, versions) that Prefect records. Stages are tasks rather than subflows
because each flow run costs about a second of Prefect overhead (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import functools
import time

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from sluiceway.flows import runtime
from sluiceway.flows.artifacts import RunArtifacts
from sluiceway.flows.config import RunConfig
from sluiceway.flows.live_run import open_run
from sluiceway.flows.logging_backends import MetricLoggers
from sluiceway.flows.opd import has_teacher_engine, teacher_metrics
from sluiceway.flows.precision import resolve_precision
from sluiceway.flows.retry import call_retrying, retry_delays, retry_transient
from sluiceway.flows.scaffold import checkpoint_due
from sluiceway.infra.errors import Fault
from sluiceway.storage.maintenance import maintain_run
from sluiceway.storage.metrics import append_metrics
from sluiceway.storage.stages import finished_stage, record_stage
from sluiceway.storage.trajectories import read_trajectories, row_failure
from sluiceway.tasks.evaluate.evaluate import evaluate
from sluiceway.tasks.filter.apply import filter_step
from sluiceway.tasks.filter.filters import build_filters
from sluiceway.tasks.reward.score import rescore_non_finite, score_step
from sluiceway.tasks.rollout.prompts import adaptive_step_prompts, eval_rollout_settings
from sluiceway.tasks.rollout.rollout import plan_step, prompt_indices_for_step, run_rollout
from sluiceway.tasks.rollout.slime_plugins.hooks import run_step_hooks
from sluiceway.tasks.train.batch import build_train_samples, max_staleness, rollout_metrics

# The model state lives in the process, so Prefect must not cache these tasks; idempotency comes from
# the tables instead (a re-run skips groups and rewards already stored).


def _ledgered(stage: str):
    """Run the stage once per (run id, step): a finished stage returns its recorded result (storage/stages.py)."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(run_id: str, step: int) -> dict:
            rt = runtime.get(run_id)
            store = rt.store
            # The curriculum lives in memory: a resumed run re-observes rewards (stored ones are not re-scored).
            relearn = stage == "reward" and rt.prep.adaptive is not None
            done = None if relearn else finished_stage(store, run_id, step, stage)
            if done is not None:
                return done | {"resumed": True}
            result = fn(run_id, step)
            record_stage(store, run_id, step, stage, result)
            return result

        return run

    return wrap


@task(name="rollout", cache_policy=NO_CACHE, persist_result=False)
@_ledgered("rollout")
def rollout_task(run_id: str, step: int) -> dict:
    started = time.time()
    rt = runtime.get(run_id)
    rt.engines.prune_dead()
    s = rt.settings
    if rt.prep.adaptive is not None:
        new = adaptive_step_prompts(rt.cfg, rt.prep.adaptive, rt.store, rt.prep.tokenizer, step, s.groups_submitted)
    else:
        idx = prompt_indices_for_step(len(rt.prompts), step, s.groups_submitted, rt.cfg.training.seed)
        new = [rt.prompts[i] for i in idx]
    work = plan_step(rt.store, run_id, step, new, s, rt.prompts)
    version_at_start = rt.engines.weight_version
    min_version = pool_min_version(rt.cfg, step, version_at_start) if rt.engines.has_pools else None
    res = rt.engines.run(
        run_rollout(
            group_filter=rt.prep.rollout_filter,
            dispatcher=rt.engines.dispatcher(s.max_concurrency, min_version),
            store=rt.store,
            run_id=run_id,
            step=step,
            work=work,
            settings=s,
            decode=rt.decode,
            on_progress=lambda done, need: rt.console.update(f"rollout step {step + 1}", done, need),
        )
    )
    if res.groups_completed == 0 and (res.groups_aborted or res.groups_failed):
        _nothing_to_train(rt.store, run_id, step, res.groups_aborted + res.groups_failed)
    # Wall-clock bounds and the weights the engines held at the start: what overlap and staleness are measured by.
    return dataclasses.asdict(res) | {"started": started, "ended": time.time(), "engine_version": version_at_start}


def _nothing_to_train(store, run_id: str, step: int, groups: int) -> None:
    """No group of the step has a sample to train (a prompt longer than the limit, an agent or plugin that always
    fails, engines that abort everything): training on nothing, step after step, would end the run 'successfully'
    having learnt nothing. The rollout stage fails instead, naming the first sample's own reason (a sibling cut
    short because another failed says only "finish reason abort"); a resume generates those groups again
    (tasks/rollout/rollout.py `Rollout.retries`)."""
    rows = [r for r in read_trajectories(store, run_id, step).to_pylist() if r.get("filter_reason") is None]
    reasons = [why for r in rows if (why := row_failure(r))] or [f"finish reason {r['finish_reason']}" for r in rows]
    raise Fault(
        f"rollout: none of the {groups} groups of step {step} has a sample to train: every sample was aborted or "
        f"failed (the first: {reasons[0] if reasons else 'no row stored'}). Fix the cause, then "
        f"`sluiceway resume` generates the step again"
    )


def pool_min_version(cfg: RunConfig, step: int, engines_version: int) -> int:
    """The oldest weight version a remote pool may serve to take groups of ``step``.

    In sync and one-step-off mode a pool must be as current as the run's own engines. In fully-async mode it
    may lag the version that will train on the step (the trainer's version equals the steps it trained) by up
    to max_staleness, but never needs to be newer than the run's own engines.
    """
    if cfg.rollout.mode != "fully-async":
        return engines_version
    return min(engines_version, step - cfg.rollout.steps_ahead)


@task(name="reward", cache_policy=NO_CACHE, persist_result=False)
@_ledgered("reward")
def reward_task(run_id: str, step: int) -> dict:
    rt = runtime.get(run_id)
    out = dataclasses.asdict(score_step(store=rt.store, run_id=run_id, step=step, settings=rt.rewards))
    if rt.prep.adaptive is not None:  # the curriculum learns from this step's rewards, once
        rows = read_trajectories(rt.store, run_id, step).to_pylist()
        out["levels"] = rt.prep.adaptive.observe_step(step, rows)
    return out


@task(name="teacher", cache_policy=NO_CACHE, persist_result=False)
@_ledgered("teacher")
def teacher_task(run_id: str, step: int) -> dict:
    """On-policy distillation (opd_type sglang): the teacher scores the step's samples into the table, once;
    a resumed step finds the stage in the ledger (and the log-probs in the table) and asks nothing."""
    rt = runtime.get(run_id)
    rt.console.update(f"teacher step {step + 1}", 0, 1)
    return dataclasses.asdict(rt.teacher.score_step(rt.store, run_id, step))


@task(name="filter", cache_policy=NO_CACHE, persist_result=False)
@_ledgered("filter")
def filter_task(run_id: str, step: int) -> dict:
    rt = runtime.get(run_id)
    filters = build_filters(rt.cfg.rollout, current_version=rt.trainer.weight_version,
                            slime_args=rt.prep.slime_args)  # fmt: skip
    metrics = filter_step(store=rt.store, run_id=run_id, step=step, filters=filters).metrics()
    # slime's per-step rollout hooks, on the scored and filtered step (tasks/rollout/slime_plugins/hooks.py)
    return metrics | run_step_hooks(rt.cfg.rollout, rt.prep.slime_args, rt.store, run_id, step, metrics)


@task(name="train", cache_policy=NO_CACHE, persist_result=False)
def train_task(run_id: str, step: int) -> dict:
    rt = runtime.get(run_id)
    table = read_trajectories(rt.store, run_id, step)
    # Rows with a NaN reward from an older build are scored again (tasks/reward/score.py `has_reward` says why).
    table = rescore_non_finite(store=rt.store, run_id=run_id, step=step, settings=rt.rewards, table=table)
    a = rt.cfg.algorithm
    samples = build_train_samples(table, a.advantage_estimator, a.normalize_advantages_by_std)
    metrics = rollout_metrics(table)
    trained_at = rt.trainer.weight_version  # the version these samples update
    started = time.time()
    rt.console.update(f"train step {step + 1}", 0, 1)
    # Trainer metrics are train/NAME; those named GROUP/NAME keep their group (opd/reverse_kl).
    metrics.update({k if "/" in k else f"train/{k}": v for k, v in rt.trainer.train_rollout(samples, step).items()})
    metrics["weight_version"] = float(rt.trainer.weight_version)
    metrics["time/train_start"], metrics["time/train_end"] = started, time.time()
    metrics["rollout/staleness_max"] = float(max_staleness(table, trained_at))
    return metrics


@task(name="upkeep", cache_policy=NO_CACHE, persist_result=False)
def upkeep_task(run_id: str, step: int) -> dict:
    """Compact, checkpoint and clean the run's tables within the replay retention (storage/maintenance.py)."""
    rt = runtime.get(run_id)
    st = rt.cfg.storage
    done = maintain_run(rt.store, run_id, step + 1, st.retention_hours, idempotency_hours=st.idempotency_hours)
    return {
        u.table: {
            "version": u.version,
            "compacted": u.files_compacted,
            "vacuumed": u.files_vacuumed,
            "seconds": round(u.seconds, 3),
        }
        for u in done
    }


def upkeep_due(cfg: RunConfig, step: int) -> bool:
    every = cfg.storage.maintenance_interval
    return bool(every) and (step + 1) % every == 0


@task(name="sync", cache_policy=NO_CACHE, persist_result=False)
def sync_task(run_id: str, step: int) -> dict:
    """Publish the new weights to every engine (update_weights_interval may skip a step)."""
    rt = runtime.get(run_id)
    path = rt.sync_weights(step)  # None: update_weights_interval skipped this step
    return {"weight_version": rt.trainer.weight_version, "weights": None if path is None else str(path)}


@task(name="checkpoint", cache_policy=NO_CACHE, persist_result=False)
def checkpoint_task(run_id: str, step: int) -> dict:
    """The step's last stage: everything it logged is stored, so a resume starts after it (flows/scaffold.py)."""
    return {"checkpoint": runtime.get(run_id).save_checkpoint(step)}


@task(name="evaluate", cache_policy=NO_CACHE, persist_result=False)
def eval_task(run_id: str, trained_steps: int) -> dict:
    """Evaluate the weights after `trained_steps` steps; metrics (tag 'eval') and samples stored under that step."""
    rt = runtime.get(run_id)
    c = rt.cfg
    settings = eval_rollout_settings(c, rt.settings)
    m: dict[str, float] = {}
    for name, prompts in rt.prep.eval_prompts.items():
        m |= rt.engines.run(
            evaluate(
                client=rt.engines.client,
                prompts=prompts,
                settings=settings,
                reward_settings=rt.rewards,
                n_samples=c.eval.n_samples_per_eval_prompt,
                tag=f"{run_id}/{trained_steps}/{name}",
                decode=rt.decode,
                name=name,
                store=rt.store,  # the samples go to the evals table
                run_id=run_id,
                step=trained_steps,
            )
        )
    append_metrics(rt.store, run_id, trained_steps, m, tag="eval")
    if not c.logging.quiet:
        scores = "  ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in m.items() if not k.endswith("/prompts"))
        print(f"eval after {trained_steps:>3} steps  {scores}", flush=True)
    return m


class _Stages:
    """The stage tasks with the run's retry policy, and the schedule of generation relative to training.

    Generation of a step (rollout, then reward) runs as Prefect futures on the flow's thread pool, chained so
    that one step's generation starts after the previous step's rewards (the engines serve one step at a time
    and the curriculum sees rewards in order). Training, filtering and weight sync stay on the flow's thread.
    How far generation may run ahead of training is the mode: 0 steps (sync), 1 (one-step-off), or
    max_staleness (fully-async, default 2).
    """

    def __init__(self, cfg: RunConfig):
        d = cfg.durability
        retry = dict(
            retries=len(delays := retry_delays(d)),
            retry_delay_seconds=delays or 0,
            retry_condition_fn=retry_transient,
        )
        self.cfg = cfg
        self.rollout = rollout_task.with_options(**retry)
        self.reward = reward_task.with_options(**retry)
        self.sync_ = sync_task.with_options(**retry)
        self.checkpoint = checkpoint_task.with_options(**retry)
        self.upkeep = upkeep_task.with_options(**retry)
        self.filter = filter_task
        self.teacher = teacher_task.with_options(**retry) if has_teacher_engine(cfg) else None
        self.train = train_task  # a failed optimizer step is not retried: it may have half-applied
        self.ahead = cfg.rollout.steps_ahead
        self.pending: dict[int, tuple] = {}
        self.last = None  # the newest generation chain's final future

    def generate_ahead(self, step: int, total: int) -> None:
        for s in range(step, min(step + self.ahead, total - 1) + 1):
            if s in self.pending:
                continue
            wait = [self.last] if self.last is not None else []
            roll = self.rollout.submit(self.cfg.run_id, s, wait_for=wait)
            rew = self.reward.submit(self.cfg.run_id, s, wait_for=[roll])
            # OPD: the teacher scores the step after its rewards, still ahead of training in the async modes.
            tea = self.teacher.submit(self.cfg.run_id, s, wait_for=[rew]) if self.teacher is not None else None
            self.pending[s] = (roll, rew, tea)
            self.last = tea if tea is not None else rew

    def generated(self, step: int) -> tuple[dict, dict, dict | None]:
        """The step's rollout, reward and (with OPD's engine teacher, else None) teacher stage results."""
        roll, rew, tea = self.pending.pop(step)
        return roll.result(), rew.result(), tea.result() if tea is not None else None

    def wait_in_flight(self) -> None:
        for _, rew, tea in self.pending.values():
            last = tea if tea is not None else rew
            last.wait()
            if last.state.is_failed():
                last.result()  # raises the stage's error here, on the flow's thread

    def sync(self, run_id: str, step: int) -> dict:
        return self.sync_(run_id, step)


def format_step(step: int, total: int, m: dict, seconds: float) -> str:
    return (
        f"step {step + 1:>3}/{total}  reward {m['reward_mean']:.3f}  len {m['response_len_mean']:5.1f}"
        f"  zero-std groups {m['zero_std_group_frac']:.2f}  loss {m.get('train/loss', float('nan')):+.4f}"
        f"  grad {m.get('train/grad_norm', float('nan')):.3f}  v{int(m['weight_version'])}  {seconds:.1f}s"
    )


@flow(name="sluiceway-rl", log_prints=False)
def rl_flow(config: RunConfig) -> dict:
    """Run `config` (a RunConfig or its dict: no secrets are in it) from its last checkpoint to the end.

    Typed as the pydantic model so a deployment's parameter form in the Prefect UI is the run config.
    """
    cfg = resolve_precision(RunConfig.model_validate(config))  # auto -> bf16/fp32 (a UI run starts here)
    history, loggers = [], None
    # The CLI opened the run already (flows/live_run.py); a deployment's run opens it here.
    with open_run(cfg, "run") as live_run, live_run.serving(runtime.Runtime.create(cfg, live_run), _close) as rt:
        arts = RunArtifacts(cfg, cfg.rollout.num_rollout)
        try:
            loggers = MetricLoggers.open(cfg)  # TensorBoard always, wandb when asked
            start = rt.resume()
            arts.start(start)
            total = cfg.rollout.num_rollout
            interval = cfg.eval.eval_interval
            if interval and start == 0:
                loggers.log(0, eval_task(cfg.run_id, 0))  # the baseline
            stages = _Stages(cfg)
            for step in range(start, total):
                t0 = time.perf_counter()
                stages.generate_ahead(step, total)  # sync: this step; async modes: also the next ones
                roll, rew, tea = stages.generated(step)
                arts.progress(step + 0.5)
                kept = stages.filter(cfg.run_id, step)
                m = stages.train(cfg.run_id, step)
                m.update(kept)
                if cfg.rollout.mode == "one-step-off":
                    stages.wait_in_flight()  # the next step's samples all come from the weights before this update
                stages.sync(cfg.run_id, step)
                m.update(
                    {
                        "time/step_s": time.perf_counter() - t0,
                        "time/rollout_s": roll["gen_time_s"],
                        "time/rollout_start": roll["started"],
                        "time/rollout_end": roll["ended"],
                        "rollout/engine_version": float(roll["engine_version"]),
                        "rollout/groups_skipped": float(roll["groups_skipped"]),
                        "rollout/groups_aborted": float(roll["groups_aborted"]),
                        "reward/errors": float(rew["errors"]),
                        **rew.get("levels", {}),
                    }
                )
                if tea is not None:
                    m.update(teacher_metrics(tea))
                d = cfg.durability
                call_retrying(append_metrics, rt.store, cfg.run_id, step, m, "train", delays=retry_delays(d),
                              what=f"storing step {step + 1}'s metrics")  # fmt: skip
                history.append(m)
                loggers.log(step, m)
                arts.progress(step + 1)
                if not cfg.logging.quiet:
                    rt.console.clear()
                    print(format_step(step, total, m, m["time/step_s"]), flush=True)
                if interval and ((step + 1) % interval == 0 or step + 1 == total):
                    stages.wait_in_flight()  # evaluation shares the engines; let generation settle first
                    loggers.log(step + 1, eval_task(cfg.run_id, step + 1))
                if checkpoint_due(cfg.training.save_interval, step, total):
                    stages.checkpoint(cfg.run_id, step)
                if upkeep_due(cfg, step):
                    stages.upkeep(cfg.run_id, step)
                arts.step_done(rt.store)  # metrics table and curves (curves.png), at most every minute
        finally:
            arts.finish(rt.store)
            if loggers is not None:
                loggers.close()
    return {
        "run_id": cfg.run_id,
        "steps": len(history),
        "tables": cfg.tables_uri,
        "final_weight_version": rt.trainer.weight_version,
    }


def _close(rt: runtime.Runtime) -> None:
    rt.close()
