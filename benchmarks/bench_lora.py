"""LoRA GRPO against full fine-tuning on the same samples: reward, trainer memory, bytes published (issue 22).

`sluiceway run` subprocesses, one after the other, with identical data, seed and rollout flags: GRPO on
SmolLM2-135M-Instruct (`env:arithmetic`, the environment's verifier as reward, `--apply-chat-template`), `--bf16`,
constant lr, no weight decay, one optimizer step per rollout, `--update-weight-mode delta --weights-full-every 100`
and every version kept on the weight store (OUTPUT_DIR/weight_store). They differ only in what trains:

- `full`: full fine-tuning, lr 1e-6 (the lr of the published GRPO recipes: DeepSeekMath's GRPO, DAPO, the slime
  and verl examples; bf16 weights with fp32 AdamW masters). Versions are the bf16 model.
- `lora`: `--lora-rank 16 --lora-alpha 32 --target-modules all-linear --lora-sync adapter`, lr 1e-5. The base is
  frozen (bf16), the adapters are fp32 and their own masters. Versions are peft's adapter directory
  (adapter_model.safetensors, fp32, + adapter_config.json). Why 10x the lr: Thinking Machines' "LoRA Without
  Regret" (Schulman et al., 2025) reports LoRA's best lr about 10x full fine-tuning's, nearly independent of the
  rank, for supervised and RL post-training alike (more, about 15x, in very short runs); docs/lora.md's example
  uses 1e-5 too. No lr sweep here: one run per setting.
- `lora-merged` (optional, on by default): the same LoRA run with `--lora-sync merged`: each version is the full
  model with the adapter folded in (W + alpha/r B A in fp32, rounded to bf16), for engines without LoRA.

Same samples: every run draws the same prompts in the same order (same seed and data flags), and step 0's
rollouts come from the same base model with the same sampling seed before any update, so they are identical;
the script checks this (step 0's prompt and response token ids, per group and sample, from each run's trajectory
table, storage/trajectories.read_trajectories) and counts how many samples of each later step still equal the
full run's (fewer: after step 0 the policies differ, so the samples do). With both LoRA runs, their first
versions (the same adapter, trained on the same samples) are also compared element by element as served:
`lora-merged`'s bf16 version against `lora`'s adapter merged into the trainer's bf16 base and against the
embedded engine's merge of it (`merge_paths`).

Measured per run:
- mean reward per step (the run's metrics table, storage/metrics);
- the trainer's memory: the trainer runs in the `sluiceway run` process itself (tasks/train/launch.py: no
  torchrun group on one device; the embedded engines are child processes). Each run is started through this
  script (`--child`), which wraps `PolicyTrainer.train_rollout` to record, after every step,
  `optimizer_state_bytes()` (AdamW's moments and step counts, plus the fp32 masters where they are separate
  from the weights, i.e. full fine-tuning under --bf16), the trainable parameter count and the frozen one,
  then runs the CLI unchanged; the process's peak RSS (VmHWM, /proc/self/status) is read as it exits. The
  engines' peak RSS (their processes are polled once a second) is reported beside it;
- bytes per published version, from the weight store's manifests (kind full or delta, data_size: what a pool
  downloads). The publisher writes a delta only when it is at most half the version's raw bytes; fp32 adapters
  change in every element on every AdamW step, so their deltas are XORs of random low mantissa bits and the
  publisher is expected to write every adapter version in full. To show what an adapter delta would cost, the
  adapter versions are re-encoded here as deltas with the ratio limit lifted (max_delta_ratio 10).

    .venv/bin/python benchmarks/bench_lora.py                  # 3 runs x 6 steps, about 15-25 min on 2 cores
    .venv/bin/python benchmarks/bench_lora.py --runs full,lora --write-doc   # skip the merged run
    .venv/bin/python benchmarks/bench_lora.py --write-doc      # also refresh docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_doc import DOC, write_section  # noqa: E402  (benchmarks/ is the script's own directory)

SECTION = "## LoRA against full fine-tuning: GRPO on the same samples"  # + " (model)"
RUNS = {  # name: (lr, extra flags)
    "full": (1e-6, []),
    "lora": (1e-5, ["--lora-rank", "16", "--lora-alpha", "32", "--target-modules", "all-linear",
                    "--lora-sync", "adapter"]),
    "lora-merged": (1e-5, ["--lora-rank", "16", "--lora-alpha", "32", "--target-modules", "all-linear",
                           "--lora-sync", "merged"]),
}  # fmt: skip


def run_flags(args, name: str, out_dir: Path) -> list[str]:
    lr, extra = RUNS[name]
    return [
        "run", "--hf-checkpoint", args.model, "--prompt-data", "env:arithmetic", "--apply-chat-template",
        "--rm-type", "env", "--advantage-estimator", "grpo", "--bf16", "--lr", str(lr),
        "--lr-decay-style", "constant", "--weight-decay", "0",
        "--rollout-batch-size", str(args.batch), "--n-samples-per-prompt", str(args.samples),
        "--global-batch-size", str(args.batch * args.samples), "--micro-batch-size", str(args.micro_batch),
        "--rollout-max-response-len", str(args.response_len), "--rollout-temperature", "1.0",
        "--num-rollout", str(args.steps), "--seed", "7", "--output-dir", str(out_dir), "--run-id", run_id(name),
        "--update-weight-mode", "delta", "--weights-full-every", "100", "--weights-keep", str(args.steps + 1),
        "--save-interval", str(10**6), "--log-level", "INFO", *extra,
    ]  # fmt: skip


def run_id(name: str) -> str:
    return f"bench-lora-{name}"


def mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def vm_hwm(pid: int | str = "self") -> int:
    """Peak resident bytes of a process (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


def child(argv: list[str]) -> int:
    """`--child RECORD CLI_ARGS...`: the CLI in this process, recording the trainer's state after every step."""
    record = Path(argv[0])
    from sluiceway.tasks.train.trainer import PolicyTrainer

    train_rollout = PolicyTrainer.train_rollout

    def recorded(self, samples, step):
        metrics = train_rollout(self, samples, step)
        trainable = sum(p.numel() for p in self.trainable.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in self.model.parameters() if not p.requires_grad)
        with record.open("a") as f:
            f.write(json.dumps({"step": step, "optimizer_state_bytes": self.optimizer_state_bytes(),
                                "trainable_params": trainable, "frozen_params": frozen,
                                "model_params": sum(p.numel() for p in self.model.parameters()),
                                "reference_model": self.ref_model is not None,
                                "rss_hwm": vm_hwm()}) + "\n")  # fmt: skip
        return metrics

    PolicyTrainer.train_rollout = recorded
    from sluiceway.flows.cli import main as cli_main

    try:
        return cli_main(argv[1:])
    finally:
        with record.open("a") as f:
            f.write(json.dumps({"exit_rss_hwm": vm_hwm()}) + "\n")


def rewards(out_dir: Path, name: str) -> list[float]:
    from sluiceway.storage.metrics import metrics_frame
    from sluiceway.storage.object_store import ObjectStore

    m = metrics_frame(ObjectStore.from_uri(str(out_dir / "tables")), run_id(name))
    col = next((c for c in ("reward/mean", "rewards/mean", "reward_mean", "reward") if c in m.columns), None)
    return [] if col is None else [round(float(x), 3) for x in m[col]]


def samples_by_step(out_dir: Path, name: str) -> dict[int, dict[tuple[int, int], tuple]]:
    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.trajectories import read_trajectories

    t = read_trajectories(ObjectStore.from_uri(str(out_dir / "tables")), run_id(name)).to_pydict()
    out: dict[int, dict] = {}
    for s, g, i, p, r in zip(t["step"], t["group_id"], t["sample_index"], t["prompt_token_ids"],
                             t["response_token_ids"]):  # fmt: skip
        out.setdefault(s, {})[(g, i)] = (tuple(p), tuple(r))
    return out


def one_run(args, name: str, work: Path) -> dict:
    out_dir = work / name
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    record = out_dir / "trainer_record.jsonl"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(record), *run_flags(args, name, out_dir)]
    log = (out_dir / "run.log").open("w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    engines: dict[int, int] = {}
    while proc.poll() is None:
        for p in descendants(proc.pid):
            if p not in engines:  # embedded engines: `sluiceway.flows.cli engine ...` (infra/engine_group.py)
                try:
                    argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                engines[p] = 0 if b"engine" in argv else -1
            if engines[p] >= 0:
                engines[p] = max(engines[p], vm_hwm(p))
        if time.perf_counter() - t0 > args.timeout:
            proc.kill()
            break
        time.sleep(1.0)
    proc.wait()
    log.close()
    wall = time.perf_counter() - t0
    text = (out_dir / "run.log").read_text()
    if proc.returncode != 0:
        sys.exit(f"run {name} failed ({proc.returncode}) after {wall:.0f} s:\n{text[-4000:]}")
    recs = [json.loads(line) for line in record.read_text().splitlines()]
    steps = [r for r in recs if "step" in r]
    exit_hwm = next((r["exit_rss_hwm"] for r in recs if "exit_rss_hwm" in r), 0)
    print(f"{name}: {wall / 60:.1f} min, {len(steps)} steps recorded", flush=True)
    return dict(name=name, lr=RUNS[name][0], wall_s=wall, steps=steps, trainer_hwm=exit_hwm,
                engine_hwm=max(engines.values(), default=0), reward=rewards(out_dir, name),
                samples=samples_by_step(out_dir, name), out_dir=out_dir)  # fmt: skip


def versions(run: dict, work: Path) -> None:
    """Manifests of the run's weight store; for adapter versions also their deltas with the ratio limit lifted."""
    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.weights import safetensors_raw as st
    from sluiceway.storage.weights.materialize import materialize
    from sluiceway.storage.weights.publish import WeightPublisher
    from sluiceway.storage.weights.store import WeightStore

    wstore = WeightStore(ObjectStore.from_uri(str(run["out_dir"] / "weight_store")))
    rows = []
    for v in wstore.versions():
        m = wstore.manifest(v)
        elements = sum(e.nbytes // st.DTYPE_WIDTH[e.dtype] for e in m.tensors.values())
        changed = sum(e.changed or 0 for e in m.tensors.values()) if m.kind == "delta" else elements
        rows.append(dict(v=v, kind=m.kind, data=m.data_size, raw=m.raw_size, changed=changed / elements,
                         dtypes=sorted({e.dtype for e in m.tensors.values()}), tensors=len(m.tensors),
                         files=sorted(m.files)))  # fmt: skip
    run["versions"] = rows
    run["forced"] = []
    if run["name"] != "lora":
        return
    forced = WeightPublisher(WeightStore(ObjectStore.from_uri(str(work / "lora_forced_store"))), full_every=100,
                             keep=1000, max_delta_ratio=10.0)  # fmt: skip
    held = None
    for v in wstore.versions():
        dest = work / "lora_pulled" / f"v{v:06d}"
        materialize(wstore, v, held, dest)
        m = forced.publish(v, dest)
        if m.kind == "delta":
            n = sum(e.nbytes // st.DTYPE_WIDTH[e.dtype] for e in m.tensors.values())
            run["forced"].append(dict(v=v, data=m.data_size, raw=m.raw_size,
                                      changed=sum(e.changed or 0 for e in m.tensors.values()) / n))  # fmt: skip
        if held is not None:
            shutil.rmtree(held)
        held = dest


def merge_paths(lora: dict, merged: dict, model_dir: Path, work: Path) -> list[dict]:
    """The two runs' first versions (both trained on step 0's identical samples), side by side: the `lora-merged`
    run's bf16 version against the `lora` run's adapter merged into the trainer's bf16 base (`merge_into_hf` on the
    base rounded to bf16, as the trainer's hf_state_dict does; equal when both runs trained the same adapter), and
    against the embedded engine's merge of that adapter (models/engine/core.py: the base model's own safetensors
    from disk, the adapter folded in, then rounded to the engine's bf16): the share of bf16 elements that differ."""
    import torch

    from sluiceway.models.lora import merge_into_hf, read_adapter_dir
    from sluiceway.models.zoo import load_hf_state_dict
    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.weights.materialize import materialize
    from sluiceway.storage.weights.store import WeightStore

    base = load_hf_state_dict(model_dir)
    base16 = {k: t.to(torch.bfloat16) for k, t in base.items()}
    stores = [WeightStore(ObjectStore.from_uri(str(r["out_dir"] / "weight_store"))) for r in (lora, merged)]
    out = []
    for v in sorted(set(stores[0].versions()) & set(stores[1].versions()))[:1]:
        a_dir, m_dir = work / "merge_check" / f"a{v}", work / "merge_check" / f"m{v}"
        materialize(stores[0], v, None, a_dir)
        materialize(stores[1], v, None, m_dir)
        spec, adapter = read_adapter_dir(a_dir)
        published = load_hf_state_dict(m_dir)
        trainer_path = merge_into_hf(base16, adapter, spec)
        engine_path = merge_into_hf(base, adapter, spec)
        n = d_trainer = d_engine = 0
        for k, t in published.items():
            bits = t.to(torch.bfloat16).view(torch.int16)
            n += t.numel()
            d_trainer += int((trainer_path[k].to(torch.bfloat16).view(torch.int16) != bits).sum())
            d_engine += int((engine_path[k].to(torch.bfloat16).view(torch.int16) != bits).sum())
        out.append(dict(v=v, trainer_path=d_trainer / n, engine_path=d_engine / n))
        shutil.rmtree(work / "merge_check", ignore_errors=True)
    return out


def same_samples(runs: list[dict]) -> tuple[bool, list[str]]:
    """Step 0 identical across runs (prompts and responses); per later step, samples equal to the first run's."""
    ref = runs[0]["samples"]
    ok0 = all(r["samples"].get(0) == ref.get(0) and ref.get(0) for r in runs[1:])
    prompts_same = all(
        {k: p for k, (p, _) in r["samples"].get(s, {}).items()} == {k: p for k, (p, _) in ref[s].items()}
        for r in runs[1:] for s in ref
    )  # fmt: skip
    notes = []
    for i, a in enumerate(runs):
        for r in runs[i + 1 :]:
            per = []
            for s in sorted(a["samples"]):
                mine, theirs = r["samples"].get(s, {}), a["samples"][s]
                per.append(f"{sum(mine.get(k, (None, None))[1] == resp for k, (_, resp) in theirs.items())}"
                           f"/{len(theirs)}")  # fmt: skip
            notes.append(f"`{r['name']}` vs `{a['name']}`: {', '.join(per)}")
    return ok0, [f"prompts of every step identical across runs: {'yes' if prompts_same else 'NO'}", *notes]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="zoo name or HF directory")
    ap.add_argument("--runs", default="full,lora,lora-merged", help=f"comma-separated, of {', '.join(RUNS)}")
    ap.add_argument("--steps", type=int, default=6, help="RL steps (weight versions) per run")
    ap.add_argument("--batch", type=int, default=8, help="prompts per step (--rollout-batch-size)")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt (--n-samples-per-prompt)")
    ap.add_argument("--response-len", type=int, default=32, help="--rollout-max-response-len")
    ap.add_argument("--micro-batch", type=int, default=16, help="--micro-batch-size")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds one run may take")
    ap.add_argument("--workdir", default=None, help="where the runs go (default: a temporary directory, removed)")
    ap.add_argument("--write-doc", action="store_true", help="refresh the section in docs/benchmarks.md")
    args = ap.parse_args()
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    if not names or names[0] != "full" or any(n not in RUNS for n in names) or len(set(names)) != len(names):
        ap.error(f"--runs: `full` first, then any of {', '.join(RUNS)} once each")
    if args.steps < 2:
        ap.error("--steps must be at least 2")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from sluiceway.models.zoo import resolve_checkpoint

    resolve_checkpoint(args.model)  # built or converted once, outside the runs
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-lora-"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = Path("/proc/loadavg").read_text().strip()
    t0 = time.perf_counter()
    runs = []
    for name in names:
        runs.append(one_run(args, name, work))
        versions(runs[-1], work)
    total_s = time.perf_counter() - t0
    load_after = Path("/proc/loadavg").read_text().strip()
    ok0, sample_notes = same_samples(runs)
    by = {r["name"]: r for r in runs}
    if "lora" in by and "lora-merged" in by:
        by["lora-merged"]["merge_check"] = merge_paths(by["lora"], by["lora-merged"], resolve_checkpoint(args.model),
                                                       work)  # fmt: skip

    text, section = render(args, runs, ok0, sample_notes, load_before, load_after, total_s)
    kept = [{k: v for k, v in r.items() if k not in ("samples", "out_dir")} for r in runs]
    (work / "results.json").write_text(json.dumps(dict(args=vars(args), runs=kept, ok0=ok0, notes=sample_notes,
                                                       load=[load_before, load_after], total_s=total_s)))  # fmt: skip
    print(text)
    if not ok0:
        print("WARNING: step 0's samples differ between the runs", file=sys.stderr)
    if args.write_doc:
        write_section(text, section, DOC)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


def render(args, runs, ok0, sample_notes, load_before, load_after, total_s) -> tuple[str, str]:
    by = {r["name"]: r for r in runs}
    full = by["full"]
    section = f"{SECTION} ({args.model})"
    walls = ", ".join(f"{r['name']} {r['wall_s'] / 60:.1f}" for r in runs)

    def first(r, key):
        return r["steps"][-1][key] if r["steps"] else 0

    def vstats(r):
        fulls = [v for v in r["versions"] if v["kind"] == "full"]
        deltas = [v for v in r["versions"] if v["kind"] == "delta"]
        return fulls, deltas

    lines = [
        section,
        "",
        f"`benchmarks/bench_lora.py` ({time.strftime('%Y-%m-%d')}): {len(runs)} `sluiceway run`s of GRPO on "
        f"`{args.model}`, one after the other, with the same data, seed and rollout flags: `env:arithmetic` with "
        f"the environment's verifier as reward, {args.batch} prompts x {args.samples} samples per step, responses "
        f"up to {args.response_len} tokens, one optimizer step per rollout, {args.steps} steps, `--bf16`, constant "
        "lr, no weight decay, `--update-weight-mode delta --weights-full-every 100` with every version kept on the "
        "weight store. `full`: full fine-tuning at lr 1e-6 (the published GRPO recipes' lr). `lora`: rank 16, "
        "alpha 32, all-linear, `--lora-sync adapter` (versions are peft's fp32 adapter), lr 1e-5: 10x, as "
        "Thinking Machines' \"LoRA Without Regret\" (Schulman et al., 2025) reports LoRA's best lr about 10x full "
        "fine-tuning's; one lr each, no sweep."
        + (
            " `lora-merged`: the same LoRA run with `--lora-sync merged` (versions are the bf16 model with the "
            "adapter folded in)."
            if "lora-merged" in by
            else ""
        )
        + f" `/proc/loadavg` `{load_before}` before, `{load_after}` after (other engineers' test suites shared the "
        f"2 cores: wall times are slow and noisy); {total_s / 60:.1f} min in all "
        f"({walls} min).",
        "",
        "```bash",
        f".venv/bin/python benchmarks/bench_lora.py --model {args.model} --runs {','.join(by)} --steps {args.steps} "
        "--write-doc",
        "```",
        "",
        "| | " + " | ".join(f"`{r['name']}`" for r in runs) + (" | lora / full |" if "lora" in by else " |"),
        "| --- | " + " | ".join("---:" for _ in runs) + (" | ---: |" if "lora" in by else " |"),
    ]

    def row(label, values, ratio=None):
        lines.append(f"| {label} | " + " | ".join(values) + (f" | {ratio} |" if "lora" in by else " |"))

    def ratio(a, b):
        return f"{a / b:.4f}" if b else "-"

    row("lr", [f"{r['lr']:g}" for r in runs], f"{by['lora']['lr'] / full['lr']:g}x" if "lora" in by else None)
    row(
        "trainable parameters",
        [f"{first(r, 'trainable_params'):,}" for r in runs],
        ratio(first(by.get("lora", full), "trainable_params"), first(full, "trainable_params")),
    )
    row("frozen parameters", [f"{first(r, 'frozen_params'):,}" for r in runs], "")
    row(
        "optimizer state MB (`optimizer_state_bytes`)",
        [mb(first(r, "optimizer_state_bytes")) for r in runs],
        ratio(first(by.get("lora", full), "optimizer_state_bytes"), first(full, "optimizer_state_bytes")),
    )
    row(
        "trainer process peak RSS MB (VmHWM)",
        [mb(r["trainer_hwm"]) for r in runs],
        ratio(by.get("lora", full)["trainer_hwm"], full["trainer_hwm"]),
    )
    row("engine process peak RSS MB", [mb(r["engine_hwm"]) for r in runs],
        ratio(by.get("lora", full)["engine_hwm"], full["engine_hwm"]))  # fmt: skip
    for r in runs:
        r["fulls"], r["deltas"] = vstats(r)
    row("versions published (full + delta)", [f"{len(r['fulls'])} + {len(r['deltas'])}" for r in runs], "")
    row("MB per full version", [mb(statistics.median(v["data"] for v in r["fulls"])) if r["fulls"] else "-"
                                for r in runs],
        ratio(statistics.median(v["data"] for v in by["lora"]["fulls"]),
              statistics.median(v["data"] for v in full["fulls"])) if "lora" in by else None)  # fmt: skip
    lora_forced = by["lora"]["forced"] if "lora" in by else []
    delta_cells = []
    for r in runs:
        if r["deltas"]:
            delta_cells.append(f"{mb(statistics.median(v['data'] for v in r['deltas']))} (median)")
        elif r["name"] == "lora" and lora_forced:
            delta_cells.append(f"none written; forced: {mb(statistics.median(v['data'] for v in lora_forced))}")
        else:
            delta_cells.append("-")
    full_delta = statistics.median(v["data"] for v in full["deltas"]) if full["deltas"] else 0
    lora_delta = (statistics.median(v["data"] for v in by["lora"]["deltas"]) if "lora" in by and by["lora"]["deltas"]
                  else statistics.median(v["data"] for v in lora_forced) if lora_forced else 0)  # fmt: skip
    row(
        "MB per delta version (lora: forced, see below)",
        delta_cells,
        ratio(lora_delta, full_delta) if "lora" in by else None,
    )
    row("MB published in all", [mb(sum(v["data"] for v in r["versions"])) for r in runs],
        ratio(sum(v["data"] for v in by["lora"]["versions"]), sum(v["data"] for v in full["versions"]))
        if "lora" in by else None)  # fmt: skip
    for s in range(args.steps):
        row(f"reward mean, step {s}", [f"{r['reward'][s]:.3f}" if s < len(r["reward"]) else "-" for r in runs], "")
    lines.append("")

    # Per-version bytes.
    lines += ["| version | " + " | ".join(f"`{r['name']}` kind, MB (elements changed)" for r in runs) + " |",
              "| --- | " + " | ".join("---" for _ in runs) + " |"]  # fmt: skip
    for i in range(max(len(r["versions"]) for r in runs)):
        cells = []
        for r in runs:
            if i >= len(r["versions"]):
                cells.append("-")
                continue
            v = r["versions"][i]
            cells.append(f"{v['kind']} {mb(v['data'])} ({v['changed']:.2%})")
        lines.append(f"| v{runs[0]['versions'][i]['v'] if i < len(runs[0]['versions']) else i + 1} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    lines.append("")

    findings = []
    findings.append(
        f"- Same samples: step 0's prompts and responses (token ids, every group and sample) are "
        f"{'identical' if ok0 else 'NOT identical'} across the runs: the same base model and sampling seed before "
        f"any update. {sample_notes[0][0].upper() + sample_notes[0][1:]}. Responses equal, per step "
        f"from step 0: {'; '.join(sample_notes[1:])}: later steps diverge, because the policies differ after "
        "the first update (and the engine's samples depend on the weights)."
    )
    if "lora" in by:
        lo = by["lora"]
        fv = [v for v in full["versions"] if v["kind"] == "full"]
        findings.append(
            f"- Trainer memory: LoRA trains {first(lo, 'trainable_params'):,} parameters "
            f"({first(lo, 'trainable_params') / max(first(full, 'trainable_params'), 1):.2%} of the model's "
            f"{first(full, 'trainable_params'):,}); its optimizer state is {mb(first(lo, 'optimizer_state_bytes'))} MB "
            f"against {mb(first(full, 'optimizer_state_bytes'))} MB (AdamW's two fp32 moments, 8 bytes a trainable "
            "parameter, plus for full fine-tuning under --bf16 the fp32 masters, 4 more; the fp32 adapters are their "
            f"own masters). The trainer process's peak RSS is {mb(lo['trainer_hwm'])} MB against "
            f"{mb(full['trainer_hwm'])} MB: it also holds the bf16 model, activations, the flow and its imports, "
            "which both runs share, so the saving is the optimizer's and the gradients', not more. No reference model "
            f"in either run (GRPO without a KL loss: reference {first(full, 'reference_model')}/"
            f"{first(lo, 'reference_model')}). The engine process peaks at {mb(lo['engine_hwm'])} MB under "
            f"`--lora-sync adapter` against {mb(full['engine_hwm'])} MB: on each adapter version it reads its base "
            "model's safetensors (fp32 on disk here) again and merges the adapter into them (models/engine/core.py "
            "`update_weights_from_disk`), so it briefly holds that copy beside the weights it serves."
            + (
                f" With `--lora-sync merged` the trainer peaks at {mb(by['lora-merged']['trainer_hwm'])} MB: it "
                "gathers the base in HF names and merges the adapter into it to write each version."
                if "lora-merged" in by
                else ""
            )
        )
        ffull = statistics.median(v["data"] for v in fv) if fv else 0
        lfull = [v for v in lo["versions"] if v["kind"] == "full"]
        lf = statistics.median(v["data"] for v in lfull) if lfull else 0
        findings.append(
            f"- Bytes per version: an adapter version is {mb(lf)} MB in full (fp32, {lo['versions'][0]['tensors']} "
            f"tensors), {ffull / max(lf, 1):.1f}x smaller than a full bf16 model ({mb(ffull)} MB). "
            + (
                f"The publisher wrote {len(lo['deltas'])} adapter delta(s). "
                if lo["deltas"]
                else f"The publisher wrote every adapter version in full ({len(lo['fulls'])} of "
                f"{len(lo['versions'])}): "
                "AdamW moves every fp32 adapter element on every step, so a delta is an XOR of changed mantissas "
                "that zstd cannot shrink below half the raw bytes, the publisher's limit for a delta. "
            )
            + (
                f"Forced through the delta codec anyway (limit lifted), adapter deltas are median "
                f"{mb(statistics.median(v['data'] for v in lora_forced))} MB "
                f"({statistics.median(v['data'] / v['raw'] for v in lora_forced):.0%} of the raw bytes, "
                f"{statistics.median(v['changed'] for v in lora_forced):.1%} of elements changed). "
                if lora_forced
                else ""
            )
            + (
                f"Full fine-tuning's bf16 deltas are median {mb(full_delta)} MB "
                f"({statistics.median(v['changed'] for v in full['deltas']):.2%} of elements changed: lr 1e-6 moves "
                "few bf16 roundings), so per update the full run's delta is "
                f"{'smaller' if full_delta < lf else 'larger'} than an adapter version "
                f"({lf / max(full_delta, 1):.1f}x); "
                f"over the {args.steps} versions, full ships {mb(sum(v['data'] for v in full['versions']))} MB "
                f"(its first version in full) against LoRA's {mb(sum(v['data'] for v in lo['versions']))} MB"
                + (
                    "; the adapter versions' total passes full fine-tuning's (one full version, then deltas) after "
                    f"about {(ffull - full_delta) / (lf - full_delta):.0f} versions: with `--weights-full-every 10` "
                    "(the default) adapters ship less, over a long delta chain full fine-tuning's bf16 deltas do."
                    if lf > full_delta
                    else "."
                )
                if full["deltas"]
                else ""
            )
        )
    if "lora-merged" in by:
        me = by["lora-merged"]
        mc = me.get("merge_check", [])
        findings.append(
            "- Adapter against merged sync: "
            + "; ".join(
                f"v{c['v']} of `lora-merged` (what its engine served for step 1) differs from `lora`'s adapter "
                f"v{c['v']} merged into the bf16 base (the trainer's) in {c['trainer_path']:.4%} of elements, and "
                f"from the embedded engine's merge of that adapter (the base's fp32 safetensors from disk + adapter, "
                f"then rounded to bf16: what `lora`'s engine served for step 1) in {c['engine_path']:.2%}"
                for c in mc
            )
            + (
                ". v1 equal bit for bit: both runs trained the same adapter on step 0's identical samples"
                if mc and mc[0]["trainer_path"] == 0
                else ". v1 NOT equal: the two runs trained different adapters on step 0 (unexpected)"
            )
            + ". The engine "
            "adds the adapter to the base's fp32 safetensors and rounds once, while the trainer computes with the "
            "bf16 base plus the adapter (which the merged version rounds), so under `--lora-sync adapter` the engine "
            "serves weights that differ from the merged version by a rounding in that share of elements: that, not "
            "training, is why `lora` and `lora-merged` sample differently from step 1 on. A small train/inference "
            "mismatch of adapter sync on a --bf16 run whose base checkpoint is fp32; merging into the base cast to "
            "the engine's dtype first would serve exactly the merged version."
            if mc
            else "- Adapter against merged sync: not compared (no common versions)."
        )
        findings.append(
            f"- `--lora-sync merged`: the first version is the full bf16 model ({mb(me['versions'][0]['data'])} MB), "
            + (
                f"later ones deltas of median {mb(statistics.median(v['data'] for v in me['deltas']))} MB "
                f"({statistics.median(v['changed'] for v in me['deltas']):.2%} of elements changed; only the adapted "
                "projections can change, the embedding and norms never do)."
                if me["deltas"]
                else "and every later one full too."
            )
        )
    rew = "; ".join(f"`{r['name']}` {statistics.mean(r['reward']):.3f}" for r in runs if r["reward"])
    findings.append(
        f"- Reward: mean over the steps {rew}. {args.batch} prompts a step over {args.steps} steps is mostly "
        "sampling noise at these learning rates; the curves say the runs train and stay sane, not which learns "
        "faster (that needs longer runs and an lr sweep per setting)."
    )
    lines += findings
    lines.append("")
    return "\n".join(lines), section


if __name__ == "__main__":
    main()
