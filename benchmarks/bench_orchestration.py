"""Prefect and Delta overhead of the RL loop: the same steps with and without them, in one run.

Variants, run interleaved (A, B, A, B, ...) from fresh run directories with the same config and seed, so
every run generates, scores and trains on the same samples:
- A: the loop as users run it: the `sluiceway-rl` Prefect flow, every stage a Prefect task (embedded Prefect,
  its progress artifacts included), trajectories and metrics in Delta tables on the local disk;
- B: the same stage functions called directly, without Prefect (each task's `.fn`, in the flow's order, the
  same metrics appended and logged), still with Delta;
- C: the stages read and write the trajectory table between them, so they cannot run without it. Instead,
  every call into `sluiceway.storage` (tables, trajectories, metrics, datasets) is timed, in this process only,
  by rebinding those functions to timed wrappers; the time spent in the outermost such calls is the
  persistence cost. Calls made during rollout overlap generation in the engine process, so for that stage it
  is an upper bound.

A step is timed from the start of its rollout to the start of the next step's rollout (the last one to the
end of the loop); engine start, trainer build and the flow's start and end are set-up, reported apart. The
first step of every run warms up (first forward/backward, first requests): medians leave it out.

    .venv/bin/python benchmarks/bench_orchestration.py                        # tiny-llama, 4 pairs x 8 steps
    .venv/bin/python benchmarks/bench_orchestration.py --model smollm2-135m-instruct --steps 3 --pairs 2
    .venv/bin/python benchmarks/bench_orchestration.py --write-doc            # also refresh docs/benchmarks.md

Shares: Prefect overhead = (A - B) / A; persistence share = Delta time / step time (in B); combined =
1 - (B - Delta time) / A, i.e. how much faster a step would be with neither. Target (issue 6): at most 3%.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_doc import DOC, write_section  # noqa: E402  (benchmarks/ is the script's own directory)

SECTION = "## Orchestration overhead: Prefect tasks and Delta persistence"  # + " (model)": one section per model
STAGES = ["rollout", "reward", "filter", "train", "sync"]


def vowel_share(response: str, label: str, sample: dict) -> tuple[float, dict]:
    """Reward for an untrained model, whose answers are noise: the share of vowels varies within a group,
    so GRPO has a gradient (the same scorer as the end-to-end test)."""
    letters = [ch for ch in response.lower() if ch.isalpha()]
    return (sum(ch in "aeiou" for ch in letters) / len(letters) if letters else 0.0), {"letters": len(letters)}


# --- timing probes (this process only) ------------------------------------------------------------------


class Probe:
    """Step boundaries, time inside each stage's code, and time inside storage calls, per stage."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.local = threading.local()
        self.reset()

    def reset(self) -> None:
        self.marks: list[float] = []  # start of each step's rollout, then the end of the loop
        self.stage_s: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self.storage_s: dict[str, float] = {}  # stage (or "flow") -> seconds in storage calls
        self.storage_calls: dict[str, int] = {}  # outermost storage function -> calls
        self.artifacts_s = 0.0  # the flow's progress artifacts
        self.stage = "flow"
        self.active = False  # between the first step's start and the loop's end

    def mark(self, end: bool = False) -> None:
        if not end and self.marks and not self.active:
            self.marks.pop()  # an "end" the loop went on from (the flow refreshes its artifacts mid-run too)
        self.marks.append(time.perf_counter())
        self.active = not end

    def storage_wrapper(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            depth = getattr(self.local, "depth", 0)
            if depth or not self.active:  # nested (trajectories -> tables): the outermost call counts
                return fn(*args, **kwargs)
            self.local.depth = 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.local.depth = 0
                with self.lock:
                    self.storage_s[self.stage] = self.storage_s.get(self.stage, 0.0) + dt
                    self.storage_calls[fn.__name__] = self.storage_calls.get(fn.__name__, 0) + 1

        timed.__wrapped_storage__ = True
        return timed

    def stage_wrapper(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if name == "rollout":
                self.mark()
            self.stage = name
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.stage_s[name] += time.perf_counter() - t0
                self.stage = "flow"

        return timed

    def artifacts_wrapper(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.active:
                    self.artifacts_s += time.perf_counter() - t0

        return timed


PROBE = Probe()


def install_storage_timers() -> int:
    """Rebind every public function of the storage modules, wherever a sluiceway module imported it."""
    import importlib

    import sluiceway.flows.rl  # noqa: F401  (import everything that binds storage functions first)
    import sluiceway.flows.runtime  # noqa: F401

    modules = ["tables", "trajectories", "metrics", "datasets", "stages", "maintenance"]
    # Plain functions on rows and Arrow tables that touch no storage (the typed sample's helpers, checks).
    pure = {
        "is_finished",
        "is_trainable",
        "group_rows",
        "conform",
        "validate_trajectories",
        "sql_literal",
        "table_schema",
        "retention_interval",
    }
    originals = {}
    for short in modules:
        mod = importlib.import_module(f"sluiceway.storage.{short}")
        for name, obj in vars(mod).items():
            if callable(obj) and getattr(obj, "__module__", None) == mod.__name__ and not name.startswith("_"):
                if isinstance(obj, type) or name in pure:
                    continue
                originals[id(obj)] = (obj, PROBE.storage_wrapper(obj))
    n = 0
    for mod in list(sys.modules.values()):
        if not getattr(mod, "__name__", "").startswith("sluiceway."):
            continue
        for name, obj in list(vars(mod).items()):
            if id(obj) in originals and originals[id(obj)][0] is obj:
                setattr(mod, name, originals[id(obj)][1])
                n += 1
    return n


def install_stage_timers() -> None:
    """Time the code inside each stage task (Prefect calls `task.fn`), and mark step starts."""
    from sluiceway.flows import rl

    for name, task in stage_tasks().items():
        task.fn = PROBE.stage_wrapper(name, task.fn)
    rl.RunArtifacts.progress = PROBE.artifacts_wrapper(rl.RunArtifacts.progress)
    finish = rl.RunArtifacts.finish

    def marked_finish(self, store):
        PROBE.mark(end=True)  # the loop is over; the flow's wrap-up is not a step
        return finish(self, store)

    rl.RunArtifacts.finish = marked_finish


_TASKS: dict = {}


def stage_tasks() -> dict:
    """The flow's Prefect task objects (kept before the flow's names are rebound to timed calls)."""
    from sluiceway.flows import rl

    if not _TASKS:
        _TASKS.update({name: getattr(rl, f"{name}_task") for name in STAGES})
    return _TASKS


# --- the variants -------------------------------------------------------------------------------------


def make_config(args, out_dir: Path):
    from sluiceway.flows.cli import make_parser, resolve_config
    from sluiceway.flows.config import RolloutConfig

    flags = [
        "run", "--hf-checkpoint", args.model, "--prompt-data", "env:arithmetic", "--env-size", "256",
        "--rollout-batch-size", str(args.batch), "--n-samples-per-prompt", str(args.samples),
        "--global-batch-size", str(args.batch * args.samples), "--micro-batch-size", str(args.micro_batch),
        "--rollout-max-response-len", str(args.response_len), "--num-rollout", str(args.steps),
        "--seed", "7", "--output-dir", str(out_dir), "--quiet",
    ]  # fmt: skip
    if args.model == "tiny-llama":  # an untrained model: a reward that varies within groups
        flags += ["--custom-rm-path", f"{Path(__file__).resolve()}:vowel_share", "--rollout-temperature", "1.0"]
        flags += ["--lr", "1e-4"]
    else:  # the demo's settings
        flags += ["--apply-chat-template", "--rm-type", "math", "--rollout-temperature", "0.7", "--lr", "5e-6"]
        flags += ["--precision", "auto"]  # what the demo uses: bf16 where this CPU computes it natively
    if args.threads:
        flags += ["--num-threads", str(args.threads)]
    if "mode" in RolloutConfig.model_fields:  # the asynchronous modes are being added to the flow
        flags += ["--mode", "sync"]  # stages in sequence: steps have boundaries, and B is the same loop
    from sluiceway.flows.precision import resolve_precision

    # As `sluiceway run` does before the flow: B calls the stages directly and would otherwise never resolve
    # precision `auto`, running in another dtype than A.
    return resolve_precision(resolve_config(make_parser().parse_args(flags)), announce=False)


def run_a(cfg) -> float:
    """The Prefect flow, as `sluiceway run` runs it (preflight handed over, then the flow)."""
    from sluiceway.flows.live_run import open_run
    from sluiceway.flows.rl import rl_flow
    from sluiceway.flows.runtime import prepare

    t0 = time.perf_counter()
    with open_run(cfg, "run") as live:
        live.prepared = prepare(cfg)
        rl_flow(cfg.model_dump(mode="json"))
    return time.perf_counter() - t0


def run_b(cfg) -> float:
    """The body of `rl_flow` without Prefect: the tasks' `.fn`, no flow, no task runs, no artifacts."""
    from sluiceway.flows import runtime
    from sluiceway.flows.live_run import open_run

    t0 = time.perf_counter()
    tasks = stage_tasks()
    with open_run(cfg, "run") as live, live.serving(runtime.Runtime.create(cfg, live), runtime.Runtime.close) as rt:
        return _steps_b(cfg, rt, tasks, t0)


def _steps_b(cfg, rt, tasks, t0) -> float:
    from sluiceway.flows.logging_backends import MetricLoggers
    from sluiceway.flows.rl import append_metrics  # the (timed) binding the flow uses

    loggers = None
    try:
        loggers = MetricLoggers.open(cfg)
        start = rt.resume()
        for step in range(start, cfg.rollout.num_rollout):
            t_step = time.perf_counter()
            roll = tasks["rollout"].fn(cfg.run_id, step)
            rew = tasks["reward"].fn(cfg.run_id, step)
            kept = tasks["filter"].fn(cfg.run_id, step)
            m = tasks["train"].fn(cfg.run_id, step)
            m.update(kept)
            tasks["sync"].fn(cfg.run_id, step)
            m.update(
                {
                    "time/step_s": time.perf_counter() - t_step,
                    "time/rollout_s": roll["gen_time_s"],
                    **{f"time/rollout_{k[:-2]}": roll[k] for k in ("started", "ended") if k in roll},
                    **({"rollout/engine_version": float(roll["engine_version"])} if "engine_version" in roll else {}),
                    "rollout/groups_skipped": float(roll["groups_skipped"]),
                    "rollout/groups_aborted": float(roll["groups_aborted"]),
                    "reward/errors": float(rew["errors"]),
                    **rew.get("levels", {}),
                }
            )
            append_metrics(rt.store, cfg.run_id, step, m, tag="train")
            loggers.log(step, m)
        PROBE.mark(end=True)
    finally:
        if loggers is not None:
            loggers.close()
    return time.perf_counter() - t0


def rewards_of(cfg) -> list[float]:
    """Per-step mean reward from the run's metrics table: A and B must agree (same samples)."""
    from sluiceway.storage.metrics import read_metrics
    from sluiceway.storage.object_store import ObjectStore

    store = ObjectStore.from_uri(cfg.tables_uri)
    rows = read_metrics(store, cfg.run_id).to_pylist()
    got = sorted((r["step"], r["value"]) for r in rows if r["name"] == "reward_mean")
    return [round(v, 4) for _, v in got]


# --- report ---------------------------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "-"


def write_doc(text: str, section: str) -> None:
    write_section(text, section, DOC)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", help="zoo name or HF directory (default tiny-llama)")
    ap.add_argument("--steps", type=int, default=8, help="RL steps per run (the first one is warm-up)")
    ap.add_argument("--pairs", type=int, default=4, help="A/B pairs, run interleaved A, B, A, B, ...")
    ap.add_argument("--batch", type=int, default=8, help="prompts per step (--rollout-batch-size)")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (--n-samples-per-prompt)")
    ap.add_argument("--response-len", type=int, default=32, help="--rollout-max-response-len")
    ap.add_argument("--micro-batch", type=int, default=16, help="--micro-batch-size")
    ap.add_argument("--threads", type=int, default=None, help="--num-threads for the trainer (default: torch's)")
    ap.add_argument("--workdir", default=None, help="where the runs go (default: a temporary directory, removed)")
    ap.add_argument("--write-doc", action="store_true", help="refresh the section in docs/benchmarks.md")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step of each run is warm-up)")

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-orch-"))
    work.mkdir(parents=True, exist_ok=True)
    from sluiceway.infra.prefect_env import configure_prefect

    configure_prefect(work)  # before prefect is imported: one embedded Prefect home for every A run
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import logging

    logging.basicConfig(level=logging.WARNING)
    n_bound = install_storage_timers()
    install_stage_timers()
    from sluiceway.models.zoo import resolve_checkpoint

    resolve_checkpoint(args.model)  # built or converted once, outside the timings

    load_before = os.getloadavg()
    t_all = time.perf_counter()
    runs: list[dict] = []
    for pair in range(args.pairs):
        for variant, fn in (("A", run_a), ("B", run_b)):
            cfg = make_config(args, work / f"{variant}{pair}")
            PROBE.reset()
            load = os.getloadavg()[0]
            wall = fn(cfg)
            steps = [b - a for a, b in zip(PROBE.marks, PROBE.marks[1:])]
            assert len(steps) == args.steps, (variant, PROBE.marks)
            r = dict(
                variant=variant, pair=pair, wall=wall, steps=steps, setup=wall - sum(steps), load=load,
                stage_s=dict(PROBE.stage_s), artifacts_s=PROBE.artifacts_s,
                storage_s=dict(PROBE.storage_s), calls=dict(PROBE.storage_calls), rewards=rewards_of(cfg),
            )  # fmt: skip
            runs.append(r)
            print(
                f"{variant}{pair}: steps {' '.join(f'{s:.2f}' for s in steps)} s, set-up {r['setup']:.1f} s, "
                f"storage {sum(r['storage_s'].values()):.2f} s, load {load:.2f}, rewards {r['rewards']}",
                flush=True,
            )
    total = time.perf_counter() - t_all
    load_after = os.getloadavg()

    def per_step(v: str) -> list[float]:  # warm steps of every run of variant v
        return [s for r in runs if r["variant"] == v for s in r["steps"][1:]]

    warm = args.steps - 1

    # Stage and storage time per warm step, per run: approximate (the first step's share is not split out),
    # so they are measured over all steps and divided by the step count.
    def run_stage(r, st):
        return r["stage_s"][st] / args.steps

    def run_storage(r, where=None):
        d = r["storage_s"]
        return (d.get(where, 0.0) if where else sum(d.values())) / args.steps

    def run_mean(r):
        return sum(r["steps"]) / args.steps

    a_steps, b_steps = per_step("A"), per_step("B")
    a_med, b_med = med(a_steps), med(b_steps)
    pairs = [(ra, rb) for ra, rb in zip(runs[0::2], runs[1::2], strict=True)]
    # Per pair ratios (all steps of the pair's runs) show the spread of the shares themselves.
    pref_pairs = [(med(ra["steps"][1:]) - med(rb["steps"][1:])) / med(ra["steps"][1:]) for ra, rb in pairs]
    b_runs = [r for r in runs if r["variant"] == "B"]
    delta_share_runs = [run_storage(r) / run_mean(r) for r in b_runs]
    delta_step = med([run_storage(r) for r in b_runs])
    delta_roll = med([run_storage(r, "rollout") for r in b_runs])
    delta_rest = delta_step - delta_roll
    pref = (a_med - b_med) / a_med
    a_runs = [r for r in runs if r["variant"] == "A"]
    # Prefect's own time on the flow's path: a step's time outside the stages' code, A less B.
    outside = {v: med([run_mean(r) - sum(run_stage(r, st) for st in STAGES) for r in runs if r["variant"] == v])
               for v in "AB"}  # fmt: skip
    direct = max(0.0, outside["A"] - outside["B"])
    direct_art = med([r["artifacts_s"] / args.steps for r in a_runs])
    dshare = delta_step / b_med
    combined = 1 - (b_med - delta_step) / a_med
    reward_gap = max(abs(x - y) for ra, rb in pairs for x, y in zip(ra["rewards"], rb["rewards"], strict=True))
    first_same = all(ra["rewards"][0] == rb["rewards"][0] for ra, rb in pairs)
    calls = {}
    for r in b_runs:
        for k, v in r["calls"].items():
            calls[k] = calls.get(k, 0) + v
    calls_per_step = ", ".join(f"`{k}` {v / (len(b_runs) * args.steps):.1f}" for k, v in sorted(calls.items()))

    import torch

    met = "met" if combined <= 0.03 else "not met"
    direct_combined = (direct + delta_step) / a_med
    met_direct = "met" if direct_combined <= 0.03 else "not met"
    dominant = "Delta persistence" if delta_step > direct else "Prefect"
    top_call = max(calls, key=calls.get) if calls else "-"
    section = f"{SECTION} ({args.model})"
    lines = [
        section,
        "",
        f"`benchmarks/bench_orchestration.py` ({time.strftime('%Y-%m-%d')}): model `{args.model}`, "
        f"{args.batch} prompts x {args.samples} samples per step, responses up to {args.response_len} tokens, "
        f"global batch {args.batch * args.samples}, micro-batch {args.micro_batch}, one embedded engine behind "
        f"sglang-router, tables on the local disk; {args.pairs} pairs of runs of {args.steps} steps, interleaved "
        f"A, B, A, B; medians over the {warm} warm steps of every run ({len(a_steps)} per variant). "
        f"{platform.machine()} CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after "
        f"(others were running tests on the machine); {total / 60:.1f} min in all.",
        "",
        "```bash",
        f".venv/bin/python benchmarks/bench_orchestration.py --model {args.model} --steps {args.steps} "
        f"--pairs {args.pairs} --write-doc",
        "```",
        "",
        "| variant | step s, median | spread (min-max) | set-up s per run | Delta s per step |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| A: Prefect flow + tasks, Delta | {a_med:.2f} | {spread(a_steps)} "
        f"| {med([r['setup'] for r in runs if r['variant'] == 'A']):.1f} "
        f"| {med([run_storage(r) for r in runs if r['variant'] == 'A']):.3f} |",
        f"| B: stage functions, no Prefect, Delta | {b_med:.2f} | {spread(b_steps)} "
        f"| {med([r['setup'] for r in b_runs]):.1f} | {delta_step:.3f} |",
        f"| C: B less its Delta time | {b_med - delta_step:.2f} | | | 0 |",
        "",
        "Time inside each stage's code, per step (mean over all steps, median over runs):",
        "",
        "| stage | A s | B s | of which Delta (B) s |",
        "| --- | ---: | ---: | ---: |",
    ]
    for st in STAGES:
        lines.append(
            f"| {st} | {med([run_stage(r, st) for r in runs if r['variant'] == 'A']):.3f} "
            f"| {med([run_stage(r, st) for r in b_runs]):.3f} | {med([run_storage(r, st) for r in b_runs]):.3f} |"
        )
    lines.append(
        f"| outside the stages' code (Prefect, metrics, logging) | {outside['A']:.3f} | {outside['B']:.3f} "
        f"| {med([run_storage(r, 'flow') for r in b_runs]):.3f} |"
    )
    lines += [
        "",
        f"- Prefect overhead (A - B) / A: **{pref:.1%}** (per pair: {', '.join(f'{p:.1%}' for p in pref_pairs)}).",
        f"- Prefect's own time, measured directly in A: {direct:.3f} s per step = {direct / a_med:.1%} of a step "
        f"(time outside the stages' code, A less B; {direct_art * 1000:.0f} ms of it for the progress artifacts): "
        "task runs, states, futures. The rest of A - B is Prefect's background work "
        f"(its API server and event threads compete for the {os.cpu_count()} cores) and noise.",
        f"- Persistence share, Delta time / step time in B: **{dshare:.1%}** (per run: "
        f"{', '.join(f'{p:.1%}' for p in delta_share_runs)}); {delta_roll:.3f} s of it during rollout "
        f"(overlapping generation, an upper bound) and {delta_rest:.3f} s in the other stages. "
        f"Storage calls per step: {calls_per_step}.",
        f"- Combined, 1 - (B - Delta) / A: **{combined:.1%}**. Target at most 3%: **{met}**.",
        f"- Combined from the direct measurements, (Prefect's own time + Delta time) / A: "
        f"**{direct_combined:.1%}**, target **{met_direct}**; the larger part is {dominant} "
        f"({delta_step:.3f} s Delta vs {direct:.3f} s Prefect per step; most frequent storage call `{top_call}`).",
        f"- Same work in A and B: the first step's mean reward is {'equal' if first_same else 'NOT equal'} in every "
        f"pair; later steps differ by at most {reward_gap:.4f} (float results on CPU depend on batch composition "
        "and timing, so a few samples can diverge once a run is under way).",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    print(f"(storage functions rebound in {n_bound} places)")
    if args.write_doc:
        write_doc(text, section)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
