"""Does bf16 learn as fp32 does? GRPO on SmolLM2-135M-Instruct, held-out reward and pass@1 (issue 31).

A task of the project's own where the model starts low: `env:arithmetic:2` (2-digit sums, "reply with just the
number"), trained for --steps steps of 8 prompts x 4 samples; held out: --held-out (64) other arithmetic prompts (a seed
the training set never uses, any overlap removed), 4 samples each at the rollout temperature, evaluated before
training and every --eval-every steps. Each variant runs for every seed, one after the other on this machine:

    fp32          the trainer, the engines and the published weights in fp32
    bf16          bf16 compute over fp32 master weights (engine and trainer give a token the same log-prob)
    bf16-icepop   bf16 with IcePop's mismatch masking (--use-tis --tis-mode icepop)
    bf16-stochastic  bf16 whose weights take the masters' values by stochastic rounding (--bf16-weight-rounding)

Reported per variant and seed: held-out reward and pass@1 at each evaluation, wall seconds per training step,
and train/logprob_mismatch (the mean |engine - trainer| log-prob of the trained tokens) per step. The whole run
takes about 15 minutes on 2 cores (AVX-512 BF16); `--write` puts the table into docs/benchmarks.md.

    .venv/bin/python benchmarks/bench_learning.py --write
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_doc

from sluiceway.storage.metrics import read_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.tasks.environments import generate_env

VARIANTS = {
    "fp32": ["--precision", "fp32"],
    "bf16": ["--precision", "bf16"],
    "bf16-icepop": ["--precision", "bf16", "--use-tis", "--tis-mode", "icepop"],
    "bf16-stochastic": ["--precision", "bf16", "--bf16-weight-rounding", "stochastic"],
}
HELD_OUT_SEED = 424242
TASK = "env:arithmetic:2"


def held_out_file(path: Path, train_seed: int, env_size: int, n: int = 32) -> Path:
    """`n` arithmetic prompts none of the training set's (`env_size` records of `train_seed`) holds."""
    seen = {r["input"] for r in generate_env(TASK, env_size, train_seed)}
    records = []
    for r in generate_env(TASK, 8 * n, HELD_OUT_SEED):
        if r["input"] not in seen and len(records) < n:
            seen.add(r["input"])
            records.append(r)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run(variant: str, seed: int, steps: int, eval_every: int, work: Path, n_held: int) -> dict:
    run_dir = work / f"{variant}-s{seed}"
    env_size = 256
    held = held_out_file(work / f"heldout-s{seed}.jsonl", seed, env_size, n_held)
    args = [
        sys.executable, "-m", "sluiceway.flows.cli", "run", "--hf-checkpoint", "smollm2-135m-instruct",
        "--prompt-data", TASK, "--env-size", str(env_size), "--seed", str(seed),
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "32",
        "--micro-batch-size", "8", "--rollout-max-response-len", "48", "--rollout-temperature", "0.7",
        "--lr", "1e-5", "--num-rollout", str(steps), "--output-dir", str(run_dir),
        "--eval-prompt-data", "heldout", str(held), "--eval-interval", str(eval_every), "--eval-size", str(n_held),
        "--n-samples-per-eval-prompt", "4", *VARIANTS[variant],
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{variant} seed {seed} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = read_metrics(ObjectStore.from_uri(str(run_dir / "tables")), run_dir.name).to_pylist()
    by = {}
    for r in rows:
        by.setdefault(r["name"], {})[r["step"]] = r["value"]
    step_s = [v for k, v in sorted(by.get("time/step_s", by.get("perf/step_s", {})).items())]
    return {
        "variant": variant, "seed": seed, "wall_s": wall,
        "eval_reward": by.get("eval/heldout/reward_mean", {}), "eval_pass1": by.get("eval/heldout/pass@1", {}),
        "mismatch": by.get("train/logprob_mismatch", {}), "step_s": step_s,
        "metric_names": sorted(by),
    }  # fmt: skip


def table(results: list[dict], steps: int) -> str:
    evals = sorted({s for r in results for s in r["eval_reward"]})
    head = " | ".join(f"reward @{s} (pass@1)" for s in evals)
    lines = [f"| variant | seed | {head} | wall s / step | logprob_mismatch (mean of steps, max) |",
             "| --- | ---: | " + " | ".join("---:" for _ in evals) + " | ---: | ---: |"]  # fmt: skip
    for r in results:
        cells = " | ".join(
            f"{r['eval_reward'].get(s, float('nan')):.3f} ({r['eval_pass1'].get(s, float('nan')):.3f})" for s in evals
        )
        mm = list(r["mismatch"].values())
        per_step = r["wall_s"] / steps
        lines.append(f"| {r['variant']} | {r['seed']} | {cells} | {per_step:.1f} | "
                     f"{statistics.fmean(mm):.2e}, {max(mm):.2e} |")  # fmt: skip
    return "\n".join(lines)


def spread(results: list[dict], steps: int) -> str:
    """Per variant over its seeds: the last evaluation's reward, mean and range, and seconds per step."""
    last = max(s for r in results for s in r["eval_reward"])
    lines = [f"| variant | seeds | reward @{last}: mean | min - max | reward @0: mean | wall s / step (mean) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for variant in VARIANTS:
        rs = [r for r in results if r["variant"] == variant and last in r["eval_reward"]]
        if not rs:
            continue
        end = [r["eval_reward"][last] for r in rs]
        start = [r["eval_reward"].get(0, float("nan")) for r in rs]
        per_step = statistics.fmean(r["wall_s"] / steps for r in rs)
        lines.append(f"| {variant} | {len(rs)} | {statistics.fmean(end):.3f} | {min(end):.3f} - {max(end):.3f} | "
                     f"{statistics.fmean(start):.3f} | {per_step:.1f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--eval-every", type=int, default=6)
    ap.add_argument("--seeds", type=int, nargs="+", default=[7, 8, 9, 10])
    ap.add_argument("--held-out", type=int, default=64, help="held-out prompts (4 samples each)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--work", type=Path, default=None, help="run directories (default: a temporary directory)")
    ap.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    ap.add_argument("--table-only", action="store_true", help="run nothing: the table of --work's results.jsonl")
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="bench-learning-"))
    work.mkdir(parents=True, exist_ok=True)
    # Every finished run is appended to WORK/results.jsonl and the table is made of all of them: a benchmark
    # stopped between runs goes on with the runs still missing (--seeds / --variants) in the same --work.
    saved = work / "results.jsonl"
    for seed in [] if a.table_only else a.seeds:
        for variant in a.variants:
            r = run(variant, seed, a.steps, a.eval_every, work, a.held_out)
            line = json.dumps({k: v for k, v in r.items() if k != "metric_names"})
            print(line, flush=True)
            with saved.open("a") as f:
                f.write(line + "\n")
    results = [json.loads(x) for x in saved.read_text().splitlines() if x.strip()]
    for r in results:  # JSON turned the step keys into strings
        for key in ("eval_reward", "eval_pass1", "mismatch"):
            r[key] = {int(k): v for k, v in r[key].items()}
    results.sort(key=lambda r: (list(VARIANTS).index(r["variant"]), r["seed"]))
    text = table(results, a.steps) + "\n\n" + spread(results, a.steps)
    print(text)
    if a.write:
        section = (
            "## bf16 against fp32: does it learn as fast? (issue 31, smollm2-135m-instruct)\n\n"
            f"`benchmarks/bench_learning.py`: GRPO on `{TASK}` (2-digit sums), {a.steps} steps of 8 prompts x 4 "
            "samples, "
            f"lr 1e-5, T 0.7; held-out reward and pass@1 on {a.held_out} other arithmetic prompts x 4 samples, "
            f"evaluated every {a.eval_every} steps (@0 is before training). Wall time per step includes the "
            "evaluations. "
            "The variants ran one after the other on the same machine.\n\n" + text + "\n"
        )
        bench_doc.write_section(section, section.split("\n", 1)[0], bench_doc.DOC)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
