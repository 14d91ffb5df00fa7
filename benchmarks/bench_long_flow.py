"""A real long run (issue 19 point 4): a tiny RL run of N steps through `sluiceway run`, killed and resumed.

One run, as a user runs it: the `sluiceway run` CLI in a subprocess (embedded engine behind the router, the
embedded Prefect server with its SQLite database in the run directory, Delta tables on the local disk), with
the run config of bench_orchestration.py (`make_config`: env:arithmetic, the vowel-share reward an untrained
model still has a gradient on, sync mode), small by default: 2 prompts x 2 samples, 4-token answers,
a checkpoint every step (`--save-interval`, so a resumed run has nothing to train again).

1. The run starts; when it prints that step `--kill-at` has finished, its whole process group is SIGKILLed,
   as a crash would (children outside the group, the Prefect server among them, die with their parent).
   The benchmark watches the run's own step lines on stdout rather than polling the tables: reading a Delta
   table from here costs more the longer the run is (issue 19) and would compete for the machine's cores.
   The tables are read once, right after the kill.
2. The same command starts again in the same run directory (same run id): it resumes from the checkpoint,
   and its stage ledger skips every rollout, reward and filter already done (`--relaunch resume` uses
   `sluiceway resume RUN_DIR` instead).
3. After the run ends, everything is read from its tables: per step, the metrics' `time/rollout_start`,
   `time/rollout_end`, `time/train_start`, `time/train_end` and the metrics row's `created_at` (a step ends
   when its metrics are written).

Reported:
- step time at the start (steps 10-29), over the last `--window` steps before the kill, and over the last
  `--window` steps of the resumed part (medians), split into rollout, reward + filter (rollout end to train
  start), train, and the rest (weight sync, checkpoint, metrics, artifacts, Prefect starting the next step's
  tasks). A step's time is the time between two steps' metrics rows, so everything the loop does is in it;
- the Prefect database (prefect/prefect.db and its -wal) and the Delta tables' size at the kill and at the end;
- how fast the run resumes: seconds from the relaunch to the first resumed step's training start, to the first
  rollout generated afresh, and to the first resumed step finished; the same for the first launch, to compare;
- that nothing was redone or lost: no step printed by the resumed part had finished before the kill, every
  step has its metrics, the stage ledger has each (step, stage) once, the trajectories table each sample once.

    .venv/bin/python benchmarks/bench_long_flow.py --steps 12 --kill-at 8              # smoke run (minutes)
    .venv/bin/python benchmarks/bench_long_flow.py --out /tmp/long-flow.json --doc     # 500 steps, kill at 400
    .venv/bin/python benchmarks/bench_long_flow.py --from-json /tmp/long-flow.json --doc   # doc from a stored run

`--doc` writes the section "## A real long run (MODEL, N steps, killed and resumed)" of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_orchestration, bench_doc: this directory
from bench_doc import machine_line, write_section  # noqa: E402
from bench_orchestration import make_config  # noqa: E402

from sluiceway.infra.proc import processes_with_env  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+)\s")  # flows/rl.py format_step, printed once a step's metrics are in
TAG = "SLUICEWAY_BENCH_TAG"  # inherited by every process of the run: finds leftovers of the killed one
TABLES = ("trajectories", "stages", "metrics")
STAMPS = ("rollout_start", "rollout_end", "train_start", "train_end")  # a step's time/... metrics (epoch s)
PARTS = ("step", "rollout", "reward+filter", "train", "rest")  # a step's time and its parts


def section_title(model: str, steps: int) -> str:
    return f"## A real long run ({model}, {steps} steps, killed and resumed)"


# --- the run -------------------------------------------------------------------------------------------------


class Launch:
    """One `sluiceway` process in its own process group; its stdout goes to a log, step lines are timed."""

    def __init__(self, cmd: list[str], env: dict, log_path: Path, on_step=None):
        self.on_step = on_step or (lambda launch, n: None)
        self.steps: list[tuple[int, float]] = []  # (1-based step printed, time.time() it was read)
        self.log = open(log_path, "a")
        self.started = time.time()
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            text=True, bufsize=1, start_new_session=True,
        )  # fmt: skip
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)
            m = STEP_LINE.match(line)
            if m:
                self.log.flush()
                self.steps.append((int(m.group(1)), time.time()))
                self.on_step(self, int(m.group(1)))

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group: the CLI and whatever shares its session
        except ProcessLookupError:
            pass

    def wait(self, stall_s: float) -> int:
        """The exit code; the run is killed if no step line came for `stall_s` seconds (a hang)."""
        while self.proc.poll() is None:
            last = self.steps[-1][1] if self.steps else self.started
            if time.time() - last > stall_s:
                self.kill()
                self.proc.wait()
                raise RuntimeError(f"no step finished for {stall_s:.0f} s; killed (see {self.log.name})")
            time.sleep(0.5)
        self.reader.join(timeout=10)
        self.log.flush()
        return self.proc.returncode


def processes_tagged(tag: str) -> list[int]:
    """Live processes whose environment holds TAG=tag (as tests/process_tags.py finds a test's processes)."""
    return processes_with_env(TAG, tag)


def sizes(run_dir: Path) -> dict:
    """Bytes of the Prefect database files and of each Delta table (files, bytes) in the run directory."""
    out = {}
    for suffix in ("", "-wal", "-shm"):
        p = run_dir / "prefect" / f"prefect.db{suffix}"
        out[f"prefect.db{suffix}"] = p.stat().st_size if p.exists() else 0
    for t in TABLES:
        files = [p for p in (run_dir / "tables" / t).rglob("*") if p.is_file()]
        out[t] = {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}
    return out


def read_run(run_dir: Path, run_id: str) -> dict:
    """Per step, from the metrics table: the step's timestamps (epoch seconds). Plus the stage ledger."""
    from sluiceway.storage.metrics import read_metrics
    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.stages import finished_stages

    store = ObjectStore.from_uri(str(run_dir / "tables"))
    steps: dict[int, dict] = {}
    wanted = {f"time/{x}" for x in (*STAMPS, "step_s")}
    for r in read_metrics(store, run_id).to_pylist():
        if r["name"] in wanted:
            s = steps.setdefault(r["step"], {})
            s[r["name"].removeprefix("time/")] = r["value"]
            s["end"] = max(s.get("end", 0.0), r["created_at"].timestamp())
            s["rows"] = s.get("rows", 0) + 1
    return {"steps": steps, "ledger": finished_stages(store, run_id)}


def trajectory_keys(run_dir: Path, run_id: str) -> tuple[int, int]:
    """(samples, distinct (step, group, sample) keys) in the trajectories table."""
    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.trajectories import read_trajectories

    table = read_trajectories(ObjectStore.from_uri(str(run_dir / "tables")), run_id)
    keys = list(zip(*(table.column(c).to_pylist() for c in ("step", "group_id", "sample_index"))))
    return len(keys), len(set(keys))


def run_benchmark(args) -> dict:
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-long-flow-"))
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / "run"
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists: give a fresh --workdir (this benchmark starts a run from step 0)")

    # The run config of bench_orchestration.py, with per-step lines on and a checkpoint every --save-interval.
    ns = argparse.Namespace(model=args.model, batch=args.batch, samples=args.samples, micro_batch=args.micro_batch,
                            response_len=args.response_len, steps=args.steps, threads=args.threads)  # fmt: skip
    config = make_config(ns, run_dir).model_dump(mode="json")
    config["logging"]["quiet"] = False
    config["training"]["save_interval"] = args.save_interval
    for key in ("retention_hours", "idempotency_hours"):  # table upkeep's windows (docs/storage.md)
        if getattr(args, key, None) is not None:
            config["storage"][key] = getattr(args, key)
    config_path = work / "long-flow.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    run_id = Path(run_dir).resolve().name
    cli = [sys.executable, "-m", "sluiceway.flows.cli"]
    first_cmd = [*cli, "run", str(config_path)]
    again_cmd = first_cmd if args.relaunch == "run" else [*cli, "resume", str(run_dir)]

    tag = uuid.uuid4().hex
    env = dict(os.environ, **{TAG: tag})
    for k in ("PREFECT_HOME", "PREFECT_API_URL"):  # the run's own embedded Prefect, in its run directory
        env.pop(k, None)
    # The reward function is bench_orchestration.py's (its path is in the config); it imports bench_doc.
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    build = f"from sluiceway.models.zoo import resolve_checkpoint; resolve_checkpoint({args.model!r})"
    subprocess.run([sys.executable, "-c", build], env=env, cwd=REPO, check=True)  # built once, outside the timings

    log_path = work / "run.log"
    load_before = os.getloadavg()[0]
    db_series: list[tuple[int, int]] = []  # (steps done, prefect.db + wal bytes) every 50 steps
    killed = threading.Event()
    t_kill = [0.0]
    t_all = time.time()

    def on_step(launch: Launch, n: int) -> None:  # on the reader thread, as the run prints step n
        if n % 50 == 0 or n == 1:
            db_series.append((n, sizes_db(run_dir)))
        if n >= args.kill_at and not killed.is_set():  # the first launch only: the relaunch finds it set
            killed.set()
            time.sleep(args.kill_delay)
            t_kill[0] = time.time()
            launch.kill()

    print(f"run: {' '.join(first_cmd)}\n  run directory {run_dir}, log {log_path}", flush=True)
    first = Launch(first_cmd, env, log_path, on_step)
    code = first.wait(args.stall_s)
    if not killed.is_set():
        raise RuntimeError(f"the run ended (exit {code}) before step {args.kill_at}; see {log_path}")
    time.sleep(2)  # parent-death signals, then look for anything of the killed run still alive
    leftovers = processes_tagged(tag)
    for pid in leftovers:  # they would compete with the resumed run for the cores
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    at_kill = read_run(run_dir, run_id)
    size_kill = sizes(run_dir)
    done_at_kill = sorted(at_kill["steps"])
    printed_first = [n for n, _ in first.steps]
    print(
        f"killed after step {printed_first[-1]} ({len(done_at_kill)} steps with metrics); "
        f"prefect.db {mb(size_kill['prefect.db'])} + wal {mb(size_kill['prefect.db-wal'])}; "
        f"{len(leftovers)} processes of the killed run were still alive",
        flush=True,
    )

    with open(log_path, "a") as f:
        f.write(f"--- killed; relaunched: {' '.join(again_cmd)}\n")
    t_relaunch = time.time()
    again = Launch(again_cmd, env, log_path, on_step)
    code = again.wait(args.stall_s)
    t_end = time.time()
    if code != 0:
        raise RuntimeError(f"the resumed run exited with {code}; see {log_path}")
    final = read_run(run_dir, run_id)
    size_end = sizes(run_dir)
    samples, distinct = trajectory_keys(run_dir, run_id)
    load_after = os.getloadavg()[0]

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_line(),
        "args": vars(args),
        # What `sluiceway` was given (after `python -m sluiceway.flows.cli`), the work directory as WORKDIR.
        "command": " ".join(first_cmd[3:]).replace(str(work), "WORKDIR"),
        "relaunch": " ".join(again_cmd[3:]).replace(str(work), "WORKDIR"),
        "run_dir": str(run_dir),
        "load": [load_before, load_after],
        "wall_s": t_end - t_all,
        "t": {"launch": first.started, "kill": t_kill[0], "relaunch": t_relaunch, "end": t_end},
        "printed_before_kill": printed_first,
        "printed_after": [n for n, _ in again.steps],
        "steps_at_kill": done_at_kill,
        "ledger_at_kill": at_kill["ledger"],
        "leftovers": len(leftovers),
        "steps": {str(k): v for k, v in sorted(final["steps"].items())},
        "ledger": final["ledger"],
        "trajectories": {"samples": samples, "distinct": distinct},
        "sizes": {"kill": size_kill, "end": size_end},
        "prefect_db_series": db_series,
    }
    if args.keep is False and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return result


def sizes_db(run_dir: Path) -> int:
    """Bytes of the Prefect database and its write-ahead log, now."""
    files = [run_dir / "prefect" / name for name in ("prefect.db", "prefect.db-wal")]
    return sum(p.stat().st_size for p in files if p.exists())


# --- the report -----------------------------------------------------------------------------------------------


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def analyse(res: dict) -> dict:
    """Step time windows, resume times and the checks, from a result of `run_benchmark`."""
    a = res["args"]
    steps = {int(k): v for k, v in res["steps"].items()}
    t = res["t"]
    before = [k for k in sorted(steps) if steps[k]["end"] < t["kill"]]
    after = [k for k in sorted(steps) if steps[k]["end"] >= t["relaunch"]]
    k_kill = (max(before) + 1) if before else 0  # steps finished before the kill (0..k_kill-1)
    first_new = min(after) if after else None

    def parts(k: int) -> dict | None:  # step k's time (previous step's metrics -> its own) and its parts
        s, p = steps.get(k), steps.get(k - 1)
        if s is None or p is None or not all(x in s for x in STAMPS):
            return None
        period = s["end"] - p["end"]
        roll = s["rollout_end"] - s["rollout_start"]
        gap = s["train_start"] - s["rollout_end"]
        train = s["train_end"] - s["train_start"]
        return {"step": period, "rollout": roll, "reward+filter": gap, "train": train,
                "rest": period - roll - gap - train}  # fmt: skip

    def window(lo: int, hi: int, floor: int) -> dict:
        ks = [k for k in range(max(lo, floor), hi) if k in steps and parts(k) is not None]
        ps = [parts(k) for k in ks]
        medians = {name: med([p[name] for p in ps]) for name in PARTS}
        return {"from": ks[0] if ks else None, "to": ks[-1] if ks else None, "n": len(ks), **medians}

    w = a["window"]
    start = window(10, min(30, k_kill), 1)  # steps 10-29, or from step 1 in a run killed early
    if start["n"] < 3:
        start = window(1, min(30, k_kill), 1)
    kill_w = window(k_kill - w, k_kill, 1)
    end_w = window(a["steps"] - w, a["steps"], (first_new or 0) + 1)

    # Resuming: from the relaunch to the first resumed step's training, its first afresh rollout, its end.
    resume = {}
    if first_new is not None:
        s = steps[first_new]
        fresh = [steps[k]["rollout_start"] for k in after if steps[k].get("rollout_start", 0) >= t["relaunch"]]
        resume = {
            "first_step": first_new,
            "to_train_start": s["train_start"] - t["relaunch"],
            "to_fresh_rollout": (min(fresh) - t["relaunch"]) if fresh else None,
            "to_step_done": s["end"] - t["relaunch"],
            "first_rollout_from_ledger": s.get("rollout_start", 0) < t["relaunch"],
        }
    launch = {}
    if 0 in steps:
        launch = {"to_rollout": steps[0]["rollout_start"] - t["launch"], "to_step_done": steps[0]["end"] - t["launch"]}

    # Nothing redone, nothing lost.
    finished = {n - 1 for n in res["printed_before_kill"]} | set(res["steps_at_kill"])
    redone = sorted(finished & {n - 1 for n in res["printed_after"]})
    missing = sorted(set(range(a["steps"])) - set(steps))
    ledger = [tuple(x) for x in res["ledger"]]
    dup_ledger = len(ledger) - len(set(ledger))
    traj = res["trajectories"]
    expected = a["steps"] * a["batch"] * a["samples"]
    return {
        "k_kill": k_kill, "start": start, "kill": kill_w, "end": end_w, "resume": resume, "launch": launch,
        "redone": redone, "missing": missing, "dup_ledger": dup_ledger, "ledger_rows": len(ledger),
        "traj_ok": traj["samples"] == traj["distinct"] == expected, "expected_samples": expected,
        "in_flight": sorted({s for k, s in map(tuple, res["ledger_at_kill"]) if k == k_kill}),
    }  # fmt: skip


def render(res: dict) -> str:
    a, z = res["args"], analyse(res)
    size_k, size_e = res["sizes"]["kill"], res["sizes"]["end"]

    def row(label: str, w: dict) -> str:
        span = f"{w['from']}-{w['to']}" if w["n"] else "-"
        return (f"| {label} | {span} | {w['step']:.2f} | {w['rollout']:.2f} | {w['reward+filter']:.2f} "
                f"| {w['train']:.2f} | {w['rest']:.2f} |")  # fmt: skip

    r, lc = z["resume"], z["launch"]
    flags = (
        f"--model {a['model']} --steps {a['steps']} --kill-at {a['kill_at']} --batch {a['batch']} --samples "
        f"{a['samples']} --response-len {a['response_len']} --save-interval {a['save_interval']}"
    )
    flags += f" --kill-delay {a['kill_delay']}" if a["kill_delay"] else ""
    for key in ("retention_hours", "idempotency_hours"):
        flags += f" --{key.replace('_', '-')} {a[key]}" if a.get(key) is not None else ""
    flags += f" --relaunch {a['relaunch']}" if a["relaunch"] != "run" else ""
    growth = z["kill"]["step"] / z["start"]["step"] if z["start"]["n"] and z["kill"]["n"] else float("nan")
    every = "step" if a["save_interval"] == 1 else f"{a['save_interval']} steps"
    lines = [
        section_title(a["model"], a["steps"]),
        "",
        f"`benchmarks/bench_long_flow.py` ({res['date']}): `sluiceway {res['command']}` in a subprocess (embedded "
        f"engine behind the router, embedded Prefect, Delta tables on the local disk), {a['batch']} prompts x "
        f"{a['samples']} samples a step, answers up to {a['response_len']} tokens, a checkpoint every "
        f"{every}; SIGKILLed (whole process group) once step {z['k_kill']} had finished, then "
        f"`sluiceway {res['relaunch']}` again. {res['wall_s'] / 60:.1f} min in all; load average "
        f"{res['load'][0]:.2f} before, {res['load'][1]:.2f} after.",
        "",
        "```bash",
        f".venv/bin/python benchmarks/bench_long_flow.py {flags} --doc",
        "```",
        "",
        "Step time, medians in seconds (a step: from the previous step's metrics row to its own; rollout; reward "
        "and filter = rollout end to train start; train; the rest = weight sync, checkpoint, metrics, artifacts, "
        "Prefect starting the next step's tasks; medians of each, so they need not add up):",
        "",
        "| window | steps | step | rollout | reward + filter | train | rest |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        row("start", z["start"]),
        row("before the kill", z["kill"]),
        row("end of the resumed part", z["end"]),
        "",
        f"- Step time before the kill / at the start: **{growth:.1f}x**.",
        f"- Prefect database (`prefect/prefect.db` + `-wal`): {mb(size_k['prefect.db'])} + "
        f"{mb(size_k['prefect.db-wal'])} at the kill, {mb(size_e['prefect.db'])} + {mb(size_e['prefect.db-wal'])} "
        f"at the end ({', '.join(f'{mb(b)} after {n}' for n, b in res['prefect_db_series'])}).",
        "- Delta tables at the end: "
        + ", ".join(f"{t} {size_e[t]['files']} files, {mb(size_e[t]['bytes'])}" for t in TABLES)
        + ".",
    ]
    if r:
        fresh = f"{r['to_fresh_rollout']:.1f} s" if r["to_fresh_rollout"] is not None else "-"
        lines.append(
            f"- Resumed in: **{r['to_step_done']:.1f} s** from the relaunch to step {r['first_step']} finished "
            f"(its training started at {r['to_train_start']:.1f} s; the first rollout generated afresh started at "
            f"{fresh}; step {r['first_step']}'s rollout was "
            f"{'taken from the stage ledger' if r['first_rollout_from_ledger'] else 'generated again'}). "
            f"The first launch: {lc.get('to_rollout', float('nan')):.1f} s to step 0's rollout, "
            f"{lc.get('to_step_done', float('nan')):.1f} s to step 0 finished."
        )
    lines.append(
        f"- Nothing redone: steps trained again after the resume: {z['redone'] or 'none'}; steps without metrics: "
        f"{z['missing'] or 'none'}; stage ledger {z['ledger_rows']} rows, {z['dup_ledger']} duplicated; "
        f"trajectories {res['trajectories']['samples']} samples, {res['trajectories']['distinct']} distinct "
        f"(expected {z['expected_samples']}); stages of step {z['k_kill']} in the ledger at the kill: "
        f"{', '.join(z['in_flight']) or 'none'}; {res['leftovers']} processes of the killed run still alive 2 s "
        "after the kill."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", help="zoo name or HF directory (default tiny-llama)")
    ap.add_argument("--steps", type=int, default=500, help="RL steps of the run (default 500)")
    ap.add_argument("--kill-at", type=int, default=400, help="SIGKILL once this many steps have finished")
    ap.add_argument("--kill-delay", type=float, default=0.0, help="seconds between that step's line and the kill")
    ap.add_argument(
        "--relaunch",
        choices=["run", "resume"],
        default="run",
        help="relaunch with the same `sluiceway run` command (default) or `sluiceway resume RUN_DIR`",
    )
    ap.add_argument("--batch", type=int, default=2, help="prompts per step (--rollout-batch-size)")
    ap.add_argument("--samples", type=int, default=2, help="samples per prompt (--n-samples-per-prompt)")
    ap.add_argument("--response-len", type=int, default=4, help="--rollout-max-response-len")
    ap.add_argument("--micro-batch", type=int, default=4, help="--micro-batch-size")
    ap.add_argument("--save-interval", type=int, default=1, help="checkpoint every N steps (default 1)")
    ap.add_argument("--threads", type=int, default=None, help="--num-threads for the trainer (default: torch's)")
    ap.add_argument("--window", type=int, default=20, help="steps per window of the step-time medians")
    ap.add_argument("--retention-hours", type=float, default=None, help="storage.retention_hours (config default)")
    ap.add_argument("--idempotency-hours", type=float, default=None, help="storage.idempotency_hours (config default)")
    ap.add_argument("--stall-s", type=float, default=600.0, help="give up if no step finishes for this long")
    ap.add_argument("--workdir", default=None, help="where the run goes (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary run directory")
    ap.add_argument("--out", default=None, help="write the results (per-step timestamps included) as JSON")
    ap.add_argument("--from-json", default=None, help="report a stored --out file instead of running")
    ap.add_argument("--doc", action="store_true", help="write the section of docs/benchmarks.md")
    args = ap.parse_args()

    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
    else:
        if not 2 <= args.kill_at < args.steps:
            ap.error("--kill-at must be at least 2 and below --steps")
        res = run_benchmark(args)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
    text = render(res)
    print(text, end="")
    if args.doc:
        a = res["args"]
        write_section(text, section_title(a["model"], a["steps"]), machine=res["machine"])


if __name__ == "__main__":
    main()
