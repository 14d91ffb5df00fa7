"""sluiceway against TRL's GRPOTrainer: same model, task, reward and hyper-parameters, on this machine, in one run.

    .venv/bin/python benchmarks/trl_vs_sluiceway/run.py            # or: make bench-trl

Creates TRL's own virtualenv once (.cache/trl-venv: TRL never enters the project's dependencies), then runs
both frameworks on SmolLM2-135M-Instruct, alternating (TRL fp32, sluiceway fp32, TRL bf16, sluiceway bf16) so
both see the same machine, and writes the section "TRL vs sluiceway" of docs/benchmarks.md.

Settings both runs share (see HYPER below for the flag-by-flag mapping): 8 prompts x 4 samples per step (32
completions), at most 32 new tokens, temperature 1.0, GRPO advantages (group mean and std), PPO clip 0.2, no
KL, token-mean loss over the batch, one optimizer step per batch, AdamW(0.9, 0.999), constant lr, grad clip 1.0,
seed 42. Each framework's step time is measured from its own step boundaries (start-up excluded; both
generate, score and train inside a step); the wall time of the whole process is reported beside it. Peak memory
is the largest sum of RSS over the framework's process tree, sampled every 0.5 s (sluiceway's tree includes its
Prefect API server, router and engine processes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "benchmarks"))

import task  # noqa: E402
from bench_doc import machine_line, with_machine, write_section  # noqa: E402

TRL_VERSION = "1.16.0"
TORCH_VERSION = "2.13.0"
SECTION = "## TRL vs sluiceway (GRPO, SmolLM2-135M-Instruct)"

# What each side is told; the left column is the shared meaning.
HYPER = [
    ("prompts x samples per step", "--rollout-batch-size 8 --n-samples-per-prompt 4",
     "num_generations=4, per_device_train_batch_size=32"),
    ("one optimizer step per batch", "--global-batch-size 32", "gradient_accumulation_steps=1, num_iterations=1"),
    ("max new tokens", "--rollout-max-response-len 32", "max_completion_length=32"),
    ("sampling", "--rollout-temperature 1.0 --rollout-top-p 1.0", "temperature=1.0, top_p=1.0"),
    ("advantages", "--advantage-estimator grpo (std-normalised)", 'scale_rewards="group"'),
    ("loss", "--loss-agg-mode token_mean --eps-clip 0.2, no KL", 'loss_type="dapo", epsilon=0.2, beta=0.0'),
    ("optimizer", "--lr 1e-5 --adam-beta2 0.999 --clip-grad 1.0, constant",
     "learning_rate=1e-5, adam_beta2=0.999, max_grad_norm=1.0, constant"),
    ("bf16", "--bf16 (bf16 weights, fp32 master copy)", "bf16=True (CPU autocast over fp32 weights)"),
    ("seed", "--seed 42", "seed=42"),
]  # fmt: skip


def ensure_trl_venv(venv: Path) -> Path:
    py = venv / "bin" / "python"
    if py.exists():
        return py
    print(f"creating TRL's virtualenv in {venv} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, f"torch=={TORCH_VERSION}"], check=True)  # first: else pip picks a CUDA build
    subprocess.run([*pip, f"trl=={TRL_VERSION}"], check=True)
    return py


class RunFailed(RuntimeError):
    """One framework's run failed: the table says so and the benchmark goes on with the others."""


class PeakRSS:
    """The largest total RSS of a process and all its descendants, sampled in a thread."""

    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        self.peak = 0
        self._root = psutil.Process(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            try:
                procs = [self._root, *self._root.children(recursive=True)]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                self.peak = max(self.peak, total)
            except psutil.Error:
                pass
            self._stop.wait(every_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_measured(cmd: list[str], log: Path, env: dict | None = None) -> tuple[float, int]:
    """Run ``cmd`` with its output in ``log``; (wall seconds, peak RSS bytes of its process tree)."""
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        rss = PeakRSS(proc.pid)
        rc = proc.wait()
        peak = rss.stop()
    if rc != 0:
        raise RunFailed(f"exit {rc}; log: {log}")
    return time.time() - t0, peak


def run_trl(py: Path, model: Path, prompts: Path, out: Path, a, bf16: bool) -> dict:
    cmd = [str(py), str(HERE / "trl_runner.py"), "--model", str(model), "--prompts", str(prompts),
           "--out", str(out), "--steps", str(a.steps), "--lr", str(a.lr), "--seed", str(a.seed)]  # fmt: skip
    cmd += ["--bf16"] if bf16 else []
    out.mkdir(parents=True, exist_ok=True)
    wall, peak = run_measured(cmd, out / "log.txt", env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    r = json.loads((out / "result.json").read_text())
    # Step k's time: from the end of step k-1 (the start of step 0) to its end.
    ends = r["step_end"]
    steps = [ends[0] - r["step_begin"][0]] + [b - e for e, b in zip(ends, ends[1:])]
    return {"step_s": steps, "rewards": r["rewards"], "wall_s": wall, "peak_rss": peak, "versions": r["versions"]}


def run_sluiceway(model: Path, prompts: Path, out: Path, a, bf16: bool) -> dict:
    from sluiceway.storage.metrics import metrics_frame
    from sluiceway.storage.object_store import ObjectStore

    cmd = [
        str(ROOT / ".venv" / "bin" / "sluiceway"), "run", "--hf-checkpoint", str(model), "--prompt-data", str(prompts),
        "--apply-chat-template", "--output-dir", str(out), "--custom-rm-path", f"{HERE / 'task.py'}:sluiceway_reward",
        "--num-rollout", str(a.steps), "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
        "--global-batch-size", "32", "--micro-batch-size", str(a.micro_batch), "--rollout-max-response-len", "32",
        "--rollout-temperature", "1.0", "--rollout-top-p", "1.0", "--advantage-estimator", "grpo",
        "--loss-agg-mode", "token_mean", "--eps-clip", "0.2", "--lr", str(a.lr), "--adam-beta2", "0.999",
        "--clip-grad", "1.0", "--seed", str(a.seed),
    ] + ["--precision", "bf16" if bf16 else "fp32"] + a.sluiceway_args.split()  # fmt: skip
    if out.exists():
        import shutil

        shutil.rmtree(out)  # a fresh run, not a resume of the last one
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    wall, peak = run_measured(cmd, log)
    m = metrics_frame(ObjectStore.from_uri(str(out / "tables")), out.name).sort_index()
    ends = list(m["time/train_end"])
    steps = [ends[0] - m["time/rollout_start"].iloc[0]] + [b - e for e, b in zip(ends, ends[1:])]
    import torch
    import transformers

    versions = {"sluiceway": git_commit(), "torch": torch.__version__, "transformers": transformers.__version__}
    return {"step_s": steps, "rewards": list(m["reward_mean"]), "wall_s": wall, "peak_rss": peak, "versions": versions}


def last_command(work_dir: Path) -> str:
    f = work_dir / "command.txt"
    return f.read_text().strip() if f.exists() else "make bench-trl"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def summary(r: dict, k: int) -> dict:
    steps = r["step_s"]
    n = len(steps)
    return {
        "s_per_step": statistics.median(steps),
        "samples_per_s": 32 * n / sum(steps),
        "wall_samples_per_s": 32 * n / r["wall_s"],
        "peak_gib": r["peak_rss"] / 2**30,
        "reward_first": statistics.mean(r["rewards"][:k]),
        "reward_mean": statistics.mean(r["rewards"]),
        "reward_last": statistics.mean(r["rewards"][-k:]),
        "wall_s": r["wall_s"],
    }


def render(results: dict, a, started: float, finished: float, load: tuple[str, str]) -> str:
    k = max(1, a.steps // 4)
    lines = [
        SECTION, "",
        f"`{a.command}` ({time.strftime('%Y-%m-%d', time.gmtime(started))}, this 2-core CPU machine, "
        f"{a.steps} steps each, runs alternating in the order of the table). s/step is the median step (its own "
        "step boundaries: generation, reward, training; start-up excluded); samples/s counts 32 completions per "
        "step over the summed step times, and over the whole process's wall time (start-up, model load and, for "
        f"sluiceway, its Prefect server included) in the next column. Reward: mean of the first and last {k} "
        "steps' training batches, and over all steps (the area under the reward curve: a run that learns sooner "
        "scores higher, where first -> last can favour a slow start). Peak memory: largest summed RSS of the "
        "process tree.", "",
        "| framework | dtype | s/step | samples/s | samples/s (wall) | wall s | peak GiB | reward first -> last "
        "| reward, mean of all steps |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for (fw, dtype), r in results.items():
        if "failed" in r:
            lines.append(f"| {fw} | {dtype} | failed: {r['failed']} | | | | | | |")
    sums = {key: summary(r, k) for key, r in results.items() if "failed" not in r}
    for (fw, dtype), s in sums.items():
        lines.append(
            f"| {fw} | {dtype} | {s['s_per_step']:.1f} | {s['samples_per_s']:.2f} | {s['wall_samples_per_s']:.2f} "
            f"| {s['wall_s']:.0f} | {s['peak_gib']:.2f} | {s['reward_first']:.3f} -> {s['reward_last']:.3f} "
            f"| {s['reward_mean']:.3f} |"
        )
    lines += ["", "Ratios, sluiceway / TRL:", ""]
    for fw, dtype in sums:
        if fw.startswith("sluiceway") and ("trl", dtype) in sums:
            s, t = sums[(fw, dtype)], sums[("trl", dtype)]
            gain_s, gain_t = s["reward_last"] - s["reward_first"], t["reward_last"] - t["reward_first"]
            lines.append(
                f"- {fw}, {dtype}: samples/s {s['samples_per_s'] / t['samples_per_s']:.2f}x (wall "
                f"{s['wall_samples_per_s'] / t['wall_samples_per_s']:.2f}x), peak memory "
                f"{s['peak_gib'] / t['peak_gib']:.2f}x, reward gain {gain_s:+.3f} vs {gain_t:+.3f} and mean reward "
                f"{s['reward_mean']:.3f} vs {t['reward_mean']:.3f} over the same number of samples"
            )
    walls = {fw: sum(s["wall_s"] for (f, _), s in sums.items() if f == fw) for fw, _ in sums}
    lines += [
        "", f"Duration: {(finished - started) / 60:.1f} min from the first run's start to the last one's end; "
        + ", ".join(f"{fw}'s runs {w / 60:.1f} min" for fw, w in walls.items()) + "."
    ]  # fmt: skip
    versions = {}
    for r in results.values():
        versions |= r.get("versions", {})
    lines += [
        "", "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) + f"; load average before "
        f"{load[0]}, after {load[1]}.", "",
        "Hyper-parameters, as each side is told:", "",
        "| setting | sluiceway | TRL GRPOConfig |", "| --- | --- | --- |",
        *[f"| {s} | `{x}` | `{y}` |" for s, x, y in HYPER], "",
        "Differences that stay: sluiceway generates with its embedded engine in its own process (continuous "
        "batching, KV cache) and trains with megatron-core in another; TRL generates with `model.generate` on "
        "the training model. TRL's gradient checkpointing is off (its default is on: slower, less memory). "
        "Prompt order differs (each shuffles the same 160 prompts with its own RNG).",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def render_stored(a) -> None:
    """The doc section again from WORK_DIR's stored results (a change to the table's layout needs no new run)."""
    stored = json.loads((a.work_dir / "results.json").read_text())
    meta = json.loads((a.work_dir / "meta.json").read_text())
    results = {tuple(k.split("|")): v for k, v in stored.items()}
    a.steps, a.command = meta["steps"], last_command(a.work_dir)
    text = render(results, a, meta["started"], meta["finished"], tuple(meta["load"]))
    machine = meta.get("machine", "not recorded with these results")  # the machine that measured, not this one
    if a.no_doc:
        print(with_machine(text, machine))
    else:
        write_section(text, SECTION, machine=machine)
        print(f"wrote {SECTION!r} to docs/benchmarks.md from {a.work_dir}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default 20)")
    p.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp32 (in this order)")
    p.add_argument("--frameworks", default="trl,sluiceway", help="comma-separated: trl, sluiceway")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--micro-batch", type=int, default=16, help="sluiceway's micro-batch (memory, not math)")
    p.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "bench_trl")
    p.add_argument("--trl-venv", type=Path, default=ROOT / ".cache" / "trl-venv")
    p.add_argument("--no-doc", action="store_true", help="print the table instead of writing docs/benchmarks.md")
    p.add_argument("--sluiceway-args", default="", help="extra `sluiceway run` flags, e.g. '--mode one-step-off'")
    p.add_argument("--add-to-last", metavar="LABEL", help="keep the last run's results (WORK_DIR/results.json) and "
                   "add these runs as framework 'sluiceway LABEL' (e.g. after a change to sluiceway)")  # fmt: skip
    p.add_argument("--render-only", action="store_true", help="write the table from the last run's stored "
                   "results (WORK_DIR/results.json, meta.json) without running anything")  # fmt: skip
    a = p.parse_args()
    a.dtypes = a.dtypes.split(",")
    if a.render_only:
        render_stored(a)
        return
    frameworks = a.frameworks.split(",")
    a.command = (
        "make bench-trl"
        if a.steps == 20 and len(a.dtypes) == 2
        else " ".join(["python", "benchmarks/trl_vs_sluiceway/run.py", *sys.argv[1:]])
    )

    from sluiceway.models.zoo import resolve_checkpoint

    model = resolve_checkpoint("smollm2-135m-instruct")
    py = ensure_trl_venv(a.trl_venv) if "trl" in frameworks else None
    a.work_dir.mkdir(parents=True, exist_ok=True)
    prompts = task.write_prompts(a.work_dir / "prompts.jsonl", 8 * a.steps, a.seed)
    started, load_before, machine = time.time(), load(), machine_line()
    results: dict[tuple[str, str], dict] = {}
    if a.add_to_last:
        last = json.loads((a.work_dir / "results.json").read_text())
        results = {tuple(k.split("|") if "|" in k else k.rsplit("-", 1)): v for k, v in last.items()}
        a.command = f"{last_command(a.work_dir)}; then {a.command}"
    for dtype in a.dtypes:
        for fw in frameworks:
            suffix = "-" + re.sub(r"\W+", "_", a.add_to_last) if a.add_to_last else ""
            out = a.work_dir / f"{fw}-{dtype}{suffix}"
            name = fw if not a.add_to_last or fw == "trl" else f"{fw} {a.add_to_last}"
            print(f"{fw} {dtype}: {a.steps} steps ...", flush=True)
            try:
                if fw == "trl":
                    results[(name, dtype)] = run_trl(py, model, prompts, out, a, dtype == "bf16")
                else:
                    results[(name, dtype)] = run_sluiceway(model, prompts, out, a, dtype == "bf16")
            except RunFailed as exc:
                results[(name, dtype)] = {"failed": str(exc)}
                print(f"  failed: {exc}", flush=True)
                continue
            s = summary(results[(name, dtype)], max(1, a.steps // 4))
            print(f"  {s['s_per_step']:.1f} s/step, {s['samples_per_s']:.2f} samples/s, peak {s['peak_gib']:.2f} GiB,"
                  f" reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}", flush=True)  # fmt: skip
            # After every run, so a benchmark cut short still leaves what it measured.
            finished, load_after = time.time(), load()
            text = render(results, a, started, finished, (load_before, load_after))
            (a.work_dir / "results.json").write_text(json.dumps({"|".join(k): v for k, v in results.items()}))
            meta = {"started": started, "finished": finished, "load": [load_before, load_after], "steps": a.steps,
                    "machine": machine}  # fmt: skip
            (a.work_dir / "meta.json").write_text(json.dumps(meta))
            (a.work_dir / "command.txt").write_text(a.command)
            if not a.no_doc:
                write_section(text, SECTION, machine=machine)
    print(with_machine(text, machine) if a.no_doc else f"wrote {SECTION!r} to docs/benchmarks.md", flush=True)


if __name__ == "__main__":
    main()
