"""Asynchronous RL under a long-tailed response-length mix: one-step-off and fully-async against sync, in one run.

The same config runs in the three `--mode`s of the `sluiceway-rl` flow, interleaved (round r starts with the
r-th mode: sync, one-step-off, fully-async, then one-step-off, fully-async, sync, ...), each run a
`sluiceway run` subprocess with its own output directory, same seed, same prompts:

- tiny-llama, a JSONL prompt set written by this script, `--rollout-batch-size` x `--n-samples-per-prompt`
  samples per step, rewards from a scorer that varies within groups (share of vowels), so GRPO has signal;
- a long-tailed length mix: `long_tail_generate` (this file, passed as `--custom-generate-function-path`)
  gives each sample its own `max_new_tokens`, drawn from its `sampling_seed` (deterministic per step, group
  and sample, so every mode generates the same lengths), EOS ignored so the lengths are exact: most samples
  short (--short LO-HI tokens), a share --long-frac long (--long LO-HI). A step's rollout is as long as its
  longest sample, and while the last long samples decode the engine's batch is nearly empty.

From each run's metrics table (per step: `time/step_s`, `time/rollout_start/end`, `time/train_start/end`,
`samples`) and trajectory table (the weight versions each sample was generated with):
- samples/s: samples trained per second of the step loop (samples / `time/step_s`), median over the steady
  steps 2..N of every run of a mode; also the aggregate (sum of samples / sum of step seconds);
- overlap: the share of training time during which some step's rollout was running (intersection of each
  step's train interval with the union of all rollout intervals);
- staleness: per trained sample, the trainer's weight version at the step minus the oldest version among its
  tokens; the mean over the steady steps, and the max.

Two core layouts (--cores), since on a CPU the engine and the trainer share the cores: `shared`, the defaults
(each starts a thread per core, so they oversubscribe when they run at once), and `split` (half the cores
each: the engine's OMP_NUM_THREADS and the trainer's --num-threads), the CPU analogue of separate devices.

    .venv/bin/python benchmarks/bench_async.py                  # tiny-llama, 2 rounds x 2 layouts x 3 modes x 6 steps
    .venv/bin/python benchmarks/bench_async.py --steps 8 --rounds 3
    .venv/bin/python benchmarks/bench_async.py --write-doc      # also refresh the section in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_doc import DOC, write_section  # noqa: E402  (benchmarks/ is the script's own directory)

SECTION = "## Asynchronous RL under a long-tailed response-length mix"  # + " (model)"
MODES = ["sync", "one-step-off", "fully-async"]
TAIL_ENV = "SLUICEWAY_BENCH_TAIL"  # the length mix, handed to the generate function in the run's process
DEFAULT_TAIL = {"short": [8, 24], "long": [96, 256], "long_frac": 0.15}


# --- loaded by the runs: the generate function and the scorer -------------------------------------------


def tail_mix() -> dict:
    return json.loads(os.environ.get(TAIL_ENV) or json.dumps(DEFAULT_TAIL))


def budget(sampling_seed: int, mix: dict) -> int:
    """A sample's response length: short with probability 1 - long_frac, else long; a function of the seed."""
    rng = random.Random(sampling_seed * 2654435761 % 2**32)
    lo, hi = mix["long"] if rng.random() < mix["long_frac"] else mix["short"]
    return rng.randint(lo, hi)


async def long_tail_generate(ctx, prompt, params):
    """One model turn with this sample's own length budget, EOS and stop tokens ignored (the length is exact)."""
    buf = ctx.new_buffer(prompt.token_ids)
    n = min(budget(params["sampling_seed"], tail_mix()), ctx.max_new_tokens)
    await ctx.generate(buf, dict(params, max_new_tokens=n, ignore_eos=True, stop_token_ids=[]))
    return buf


def vowel_share(response: str, label: str, sample: dict) -> tuple[float, dict]:
    """Reward for an untrained model: the share of vowels varies within a group, so GRPO has a gradient."""
    letters = [ch for ch in response.lower() if ch.isalpha()]
    return (sum(ch in "aeiou" for ch in letters) / len(letters) if letters else 0.0), {"letters": len(letters)}


# --- the runs -------------------------------------------------------------------------------------------

TOPICS = ["rivers", "bridges", "owls", "tides", "glaciers", "bees", "lighthouses", "maps", "clocks", "ferns"]


def write_prompts(path: Path, n: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            topic = TOPICS[i % len(TOPICS)]
            f.write(json.dumps({"prompt": f"Write about {topic}, note {i}.", "label": "-"}) + "\n")


def run_flags(args, mode: str, out_dir: Path, data: Path, cores: str) -> list[str]:
    me = Path(__file__).resolve()
    flags = [
        "run", "--hf-checkpoint", args.model, "--prompt-data", str(data), "--input-key", "prompt",
        "--label-key", "label", "--rollout-batch-size", str(args.batch), "--n-samples-per-prompt", str(args.samples),
        "--global-batch-size", str(args.batch * args.samples), "--micro-batch-size", str(args.micro_batch),
        "--rollout-max-response-len", str(args.max_len), "--num-rollout", str(args.steps),
        "--rollout-temperature", "1.0", "--lr", "1e-4", "--seed", "7", "--output-dir", str(out_dir),
        "--custom-generate-function-path", f"{me}:long_tail_generate",
        "--custom-rm-path", f"{me}:vowel_share", "--mode", mode, "--quiet",
    ]  # fmt: skip
    if mode == "fully-async":
        flags += ["--max-staleness", str(args.max_staleness)]  # how far ahead, and the filter's limit
    if cores == "split":
        flags += ["--num-threads", str(max(1, (os.cpu_count() or 2) // 2))]
    return flags


def run_once(args, mode: str, out_dir: Path, data: Path, mix: dict, cores: str) -> tuple[float, str]:
    """One `sluiceway run`. cores 'shared': engine and trainer each use every core (the defaults: torch's
    threads for the trainer, cores / engines for the engine); 'split': each gets half (OMP_NUM_THREADS for
    the engine, which the pool passes on, and --num-threads for the trainer)."""
    env = dict(os.environ, **{TAIL_ENV: json.dumps(mix)})
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(key, None)
        if cores == "split":
            env[key] = str(max(1, (os.cpu_count() or 2) // 2))
    cmd = [sys.executable, "-m", "sluiceway.flows.cli", *run_flags(args, mode, out_dir, data, cores)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{mode} run in {out_dir} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def covered(a: float, b: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans)


def analyse(out_dir: Path) -> dict:
    """Per-step numbers of one run from its metrics and trajectory tables."""
    from sluiceway.storage.metrics import metrics_frame
    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.trajectories import read_trajectories
    from sluiceway.tasks.train.batch import trainable_rows

    run_id = out_dir.resolve().name
    store = ObjectStore.from_uri(str(out_dir / "tables"))
    m = metrics_frame(store, run_id)
    steps = list(m.index)
    gen = union([(m.loc[k, "time/rollout_start"], m.loc[k, "time/rollout_end"]) for k in steps])
    per = []
    prev_version = 0.0  # a fresh run starts from version 0
    table = read_trajectories(store, run_id)
    by_step: dict[int, list[dict]] = {}
    for r in trainable_rows(table):
        by_step.setdefault(r["step"], []).append(r)
    for k in steps:
        ts, te = m.loc[k, "time/train_start"], m.loc[k, "time/train_end"]
        rows = by_step.get(k, [])
        stale = [prev_version - min(r["weight_versions"] or [r["weight_version"]]) for r in rows]
        per.append(
            dict(
                step=k,
                step_s=float(m.loc[k, "time/step_s"]),
                samples=float(m.loc[k, "samples"]),
                filtered=float(m.loc[k, "samples_filtered"]),
                rollout_s=float(m.loc[k, "time/rollout_end"] - m.loc[k, "time/rollout_start"]),
                train_s=float(te - ts),
                overlap_s=covered(ts, te, gen),
                stale=stale,
                stale_max=float(m.loc[k, "rollout/staleness_max"]),
                len_mean=float(m.loc[k, "response_len_mean"]),
                len_max=max((len(r["response_token_ids"]) for r in rows), default=0),
                reward=float(m.loc[k, "reward_mean"]),
            )
        )
        prev_version = float(m.loc[k, "weight_version"])
    return {"steps": per}


# --- report ---------------------------------------------------------------------------------------------


def agg_rate(steps: list) -> float:
    """Samples per second over steps 2..N (the first is warm-up): sum of samples over sum of step seconds."""
    return sum(x["samples"] for x in steps[1:]) / sum(x["step_s"] for x in steps[1:])


def overlap_share(steps: list) -> float:
    """The share of the training time of steps 2..N during which some rollout was running."""
    return sum(x["overlap_s"] for x in steps[1:]) / sum(x["train_s"] for x in steps[1:])


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float], fmt: str = ".1f") -> str:
    return f"{min(xs):{fmt}}-{max(xs):{fmt}}" if xs else "-"


def write_doc(text: str, section: str) -> None:
    write_section(text, section, DOC)


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", help="zoo name or HF directory (default tiny-llama)")
    ap.add_argument("--steps", type=int, default=6, help="RL steps per run (the first one is warm-up)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the three modes, interleaved")
    ap.add_argument("--batch", type=int, default=8, help="prompts per step (--rollout-batch-size)")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (--n-samples-per-prompt)")
    ap.add_argument("--micro-batch", type=int, default=16, help="--micro-batch-size")
    ap.add_argument("--short", default="8-24", help="token range of short responses (default 8-24)")
    ap.add_argument("--long", default="96-256", help="token range of long responses (default 96-256)")
    ap.add_argument("--long-frac", type=float, default=0.15, help="share of long responses (default 0.15)")
    ap.add_argument("--max-staleness", type=int, default=2, help="fully-async: steps ahead / staleness limit")
    ap.add_argument(
        "--cores",
        default="shared,split",
        help="core layouts, comma-separated: 'shared' (engine and trainer each use all cores, the defaults) and "
        "'split' (half each); default both",
    )
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, sync first (default: all three)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run before it counts as failed")
    ap.add_argument("--workdir", default=None, help="where the runs go (default: a temporary directory, removed)")
    ap.add_argument("--write-doc", action="store_true", help="refresh the section in docs/benchmarks.md")
    args = ap.parse_args()
    if args.steps < 3:
        ap.error("--steps must be at least 3 (step 1 is warm-up; steps 2..N are measured)")
    modes = args.modes.split(",")
    if modes[0] != "sync" or any(m not in MODES for m in modes):
        ap.error(f"--modes: a comma-separated subset of {','.join(MODES)} starting with sync")

    def rng_of(s: str) -> list[int]:
        lo, hi = (int(x) for x in s.split("-"))
        return [lo, hi]

    mix = {"short": rng_of(args.short), "long": rng_of(args.long), "long_frac": args.long_frac}
    args.max_len = mix["long"][1]
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-async-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "prompts.jsonl"
    write_prompts(data, 256)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sluiceway.models.zoo import resolve_checkpoint

    resolve_checkpoint(args.model)  # built once, outside the timings

    # The drawn lengths of one step (the same for every step's mix, by construction of the seeds).
    from sluiceway.tasks.rollout.rollout import sample_seed

    drawn = [budget(sample_seed(7, s, g, i), mix) for s in range(args.steps) for g in range(args.batch)
             for i in range(args.samples)]  # fmt: skip
    per_step_max = [max(drawn[s * args.batch * args.samples : (s + 1) * args.batch * args.samples])
                    for s in range(args.steps)]  # fmt: skip

    layouts = args.cores.split(",")
    if any(c not in ("shared", "split") for c in layouts):
        ap.error("--cores: a comma-separated subset of shared,split")
    load_before = loadavg()
    t_all = time.perf_counter()
    runs: list[dict] = []
    for rnd in range(args.rounds):
        order = modes[rnd % len(modes) :] + modes[: rnd % len(modes)]
        for cores in layouts:
            for mode in order:
                out = work / f"{cores}-{mode}-{rnd}"
                load = os.getloadavg()[0]
                wall, _ = run_once(args, mode, out, data, mix, cores)
                r = dict(mode=mode, cores=cores, round=rnd, wall=wall, load=load, **analyse(out))
                runs.append(r)
                st = r["steps"]
                times = " ".join(f"{x['step_s']:.2f}" for x in st)
                tr, ro = med([x["train_s"] for x in st[1:]]), med([x["rollout_s"] for x in st[1:]])
                print(
                    f"{cores:>6} {mode:>12} r{rnd}: steps {times} s, loop {sum(x['step_s'] for x in st):.1f} s "
                    f"of {wall:.1f} s, samples/s {agg_rate(st):.1f}, overlap {overlap_share(st):.0%}, "
                    f"train {tr:.2f} s, rollout {ro:.2f} s, "
                    f"len {[round(x['len_mean'], 1) for x in st]}, load {load:.2f}",
                    flush=True,
                )
    total = time.perf_counter() - t_all
    load_after = loadavg()

    stats: dict[tuple[str, str], dict] = {}
    for cores in layouts:
        for mode in modes:
            rs = [r for r in runs if r["mode"] == mode and r["cores"] == cores]
            xs = [x for r in rs for x in r["steps"][1:]]
            stale = [v for x in xs for v in x["stale"]]
            stats[cores, mode] = dict(
                rate=med([x["samples"] / x["step_s"] for x in xs]),
                rates=[x["samples"] / x["step_s"] for x in xs],
                agg=agg_rate([None, *xs]),
                step=med([x["step_s"] for x in xs]),
                rollout=med([x["rollout_s"] for x in xs]),
                train=med([x["train_s"] for x in xs]),
                overlap=overlap_share([None, *xs]),
                stale_mean=sum(stale) / len(stale) if stale else float("nan"),
                stale_max=max(x["stale_max"] for x in xs),
                filtered=sum(x["filtered"] for x in xs),
                samples=med([x["samples"] for x in xs]),
                len_mean=med([x["len_mean"] for x in xs]),
                wall=med([r["wall"] for r in rs]),
                loop=med([sum(x["step_s"] for x in r["steps"]) for r in rs]),
                by_round={r["round"]: agg_rate(r["steps"]) for r in rs},
            )
    base = "shared" if "shared" in layouts else layouts[0]
    lengths = {tuple(round(x["len_mean"], 3) for x in r["steps"]) for r in runs}
    dropped = ", ".join(f"{c} {m} {stats[c, m]['filtered']:.0f}" for c in layouts for m in modes)

    import torch

    warm = args.steps - 1
    short_mean, long_mean = sum(mix["short"]) / 2, sum(mix["long"]) / 2
    mean_len = (1 - mix["long_frac"]) * short_mean + mix["long_frac"] * long_mean
    half = max(1, (os.cpu_count() or 2) // 2)
    section = f"{SECTION} ({args.model})"
    lines = [
        section,
        "",
        f"`benchmarks/bench_async.py` ({time.strftime('%Y-%m-%d')}): model `{args.model}`, {args.batch} prompts x "
        f"{args.samples} samples per step (global batch {args.batch * args.samples}, one optimizer step per rollout, "
        f"micro-batch {args.micro_batch}), one embedded engine behind sglang-router, tables on the local disk. "
        f"Response lengths: each sample's own `max_new_tokens` (EOS ignored) drawn from its sampling seed, "
        f"{1 - mix['long_frac']:.0%} short ({mix['short'][0]}-{mix['short'][1]} tokens), "
        f"{mix['long_frac']:.0%} long ({mix['long'][0]}-{mix['long'][1]}): mean {mean_len:.0f}, a step's longest "
        f"{min(per_step_max)}-{max(per_step_max)}; the same lengths in every run and mode. fully-async with "
        f"`--max-staleness {args.max_staleness}`. Core layouts: `shared` = the defaults (engine and trainer each "
        f"run {os.cpu_count()} threads on the {os.cpu_count()} cores), `split` = {half} thread(s) each "
        f"(`OMP_NUM_THREADS={half}` for the engine, `--num-threads {half}` for the trainer). {args.rounds} rounds x "
        f"{len(layouts)} layouts x {len(modes)} modes x {args.steps} steps, interleaved (each round starts with "
        f"the next mode), each run a `sluiceway run` subprocess; medians over steps 2..{args.steps} of every run "
        f"({warm * args.rounds} steps per mode and layout). {platform.machine()} CPU, {os.cpu_count()} cores, "
        f"torch {torch.__version__}; `/proc/loadavg` `{load_before}` before, `{load_after}` after (others were "
        f"running tests on the machine); {total / 60:.1f} min in all.",
        "",
        "```bash",
        f".venv/bin/python benchmarks/bench_async.py --steps {args.steps} --rounds {args.rounds} "
        f"--cores {args.cores} --write-doc",
        "```",
        "",
        "| cores | mode | samples/s, median | spread (min-max) | aggregate samples/s | step s | rollout s | train s "
        "| training overlapped by generation | staleness mean / max | ratio to sync, same cores | per round "
        f"(aggregate) | ratio to {base} sync |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for cores in layouts:
        sync = stats[cores, "sync"]
        for mode in modes:
            s = stats[cores, mode]
            per_round = ", ".join(f"{s['by_round'][k] / sync['by_round'][k]:.2f}" for k in sorted(s["by_round"]))
            lines.append(
                f"| {cores} | {mode} | {s['rate']:.1f} | {spread(s['rates'])} | {s['agg']:.1f} | {s['step']:.2f} "
                f"| {s['rollout']:.2f} | {s['train']:.2f} | {s['overlap']:.0%} | {s['stale_mean']:.2f} / "
                f"{s['stale_max']:.0f} | **{s['rate'] / sync['rate']:.2f}x** | {per_round} "
                f"| {s['rate'] / stats[base, 'sync']['rate']:.2f}x |"
            )
    lines += [
        "",
        "Columns: samples trained per second of the step loop (`samples` / `time/step_s`, per step; aggregate: "
        "all samples over all step seconds); step, rollout and train seconds are medians per step (a step of the "
        "loop: waiting for its samples, filter, train, weight sync; rollout: the rollout task's wall time, which in "
        "the asynchronous modes runs beside the loop); overlap: the share of training time during which a rollout "
        "was running; staleness: trainer version minus the oldest weight version among a trained sample's tokens; "
        "ratios: median samples/s over sync's, and per round the aggregate over the same round's sync run.",
        "",
        f"- Same work in every run: per-step mean response lengths "
        f"{'identical across all runs' if len(lengths) == 1 else 'NOT identical across runs'} (median "
        f"{stats[base, 'sync']['len_mean']:.1f} tokens, {stats[base, 'sync']['samples']:.0f} samples per step); "
        f"samples dropped as stale: {dropped}.",
        "- Whole runs (median): "
        + ", ".join(
            f"{c} {m} {stats[c, m]['loop']:.1f} s step loop / {stats[c, m]['wall']:.1f} s process"
            for c in layouts
            for m in modes
        )
        + " (the process adds engine, router, trainer and Prefect start-up).",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write_doc:
        write_doc(text, section)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
