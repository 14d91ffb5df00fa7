"""bf16 against fp32 by role on this CPU: the trainer's step, the engine's decode, and the demo as a whole (issue 51).

On CPUs with AMX a large bf16 product runs several times fp32's rate and a decode-sized one does not, so one
precision for every role is a trade. Three measurements, each precision in a fresh process, one after the other:

    trainer  a demo-shaped GRPO step of SmolLM2-135M-Instruct (64 samples: 48 prompt + 14 response tokens,
             micro-batch 16, one optimizer step): median of 3 steps after a warm-up
    engine   the embedded engine generating 64 sequences x 24 tokens (16-token prompts, T 0.7, at most 64
             running): new tokens/s, best of 2
    demo     `sluiceway run examples/demo_smollm2.yaml` with --precision auto, fp32 and bf16 (12 steps, held-out
             greedy pass@1 before and after): wall time of the whole command, median step, what auto chose

    .venv/bin/python benchmarks/bench_precision_roles.py [--parts trainer,engine,demo] [--write]

About 3 min for trainer and engine, 9 min for the demos on the 2-core AMX Xeon; `--write` puts the tables into
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_doc

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Precision by role on CPU: trainer, engine, demo (issue 51)"
PRECISIONS = ("fp32", "bf16")


def _model() -> Path:
    from sluiceway.models.zoo import resolve_checkpoint

    return Path(resolve_checkpoint("smollm2-135m-instruct"))


def child_trainer(precision: str) -> dict:
    import random

    import torch

    from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
    from sluiceway.tasks.train.batch import TrainSample
    from sluiceway.tasks.train.trainer import PolicyTrainer

    path = _model()
    training = TrainingConfig(global_batch_size=64, micro_batch_size=16, lr=5e-6, precision=precision,
                              hf_checkpoint=str(path))  # fmt: skip
    trainer = PolicyTrainer(path, training, AlgorithmConfig(), temperature=0.7, pad_token_id=2, device="cpu")
    rng = random.Random(0)
    vocab = trainer.hf_config.vocab_size

    def batch() -> list:
        # GRPO groups: 8 prompts x 8 responses, as the demo's rollout gives them (the shared-prompt layout).
        prompts = [[rng.randrange(3, vocab) for _ in range(48)] for _ in range(8)]
        return [TrainSample(p, [rng.randrange(3, vocab) for _ in range(14)], [1] * 14, rng.uniform(-1, 1), [-5.0] * 14)
                for p in prompts for _ in range(8)]  # fmt: skip

    trainer.train_rollout(batch(), 0)  # warm-up: kernels, packing, allocator
    times = []
    for step in range(1, 4):
        t0 = time.perf_counter()
        trainer.train_rollout(batch(), step)
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "threads": torch.get_num_threads()}


def child_engine(precision: str) -> dict:
    import torch

    from sluiceway.models.engine.calls import GenerateRequest, SamplingParams
    from sluiceway.models.engine.core import Engine

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    engine = Engine(_model(), dtype=dtype, max_running_requests=64, max_total_len=64, load_tokenizer=False)
    g = torch.Generator().manual_seed(0)
    try:
        best = float("inf")
        for rep in range(3):
            requests = [GenerateRequest(torch.randint(3, 49152, (16,), generator=g).tolist(),
                                        SamplingParams(max_new_tokens=24, temperature=0.7, ignore_eos=True,
                                                       sampling_seed=i), rid=f"{rep}-{i}")
                        for i in range(64)]  # fmt: skip
            t0 = time.perf_counter()
            engine.generate(requests, timeout=600)
            if rep:  # the first: warm-up
                best = min(best, time.perf_counter() - t0)
    finally:
        engine.shutdown()
    return {"tokens_per_s": 64 * 24 / best}


def in_child(part: str, precision: str) -> dict:
    cmd = [sys.executable, __file__, "--child", part, "--precision", precision]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def demo(precision: str, work: Path) -> dict:
    out_dir = work / f"demo-{precision}"
    cmd = [str(ROOT / ".venv" / "bin" / "sluiceway"), "run", "examples/demo_smollm2.yaml", "--precision", precision,
           "--output-dir", str(out_dir)]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    text = done.stdout + done.stderr
    if done.returncode:
        raise SystemExit(f"demo --precision {precision} failed:\n{text[-3000:]}")
    steps = [float(m) for m in re.findall(r"^step\s+\d+/\d+ .* (\d+\.\d)s$", text, re.M)]
    evals = re.findall(r"^eval after\s+(\d+) steps .*arith/pass@1 ([\d.]+)", text, re.M)
    chosen = re.search(r"precision: (\w+) \((.*)\)$", text, re.M)
    rewards = [float(r) for r in re.findall(r"^step\s+\d+/\d+\s+reward ([\d.]+)", text, re.M)]
    return {
        "wall_s": wall,
        "median_step_s": statistics.median(steps) if steps else float("nan"),
        "pass_first": float(evals[0][1]) if evals else float("nan"),
        "pass_last": float(evals[-1][1]) if evals else float("nan"),
        "reward_first3": statistics.mean(rewards[:3]) if rewards else float("nan"),
        "reward_last3": statistics.mean(rewards[-3:]) if rewards else float("nan"),
        "chosen": chosen.group(1) if chosen else "?",
        "reason": chosen.group(2) if chosen else "",
    }


def render(results: dict) -> str:
    lines = [SECTION, "", f"{bench_doc.MACHINE_PREFIX}{bench_doc.machine_line()}.", ""]
    lines += [
        "`benchmarks/bench_precision_roles.py`: each precision in a fresh process, one after the other, nothing else",
        "running. On a CPU whose bf16 products vary with their row count (AMX) both the engine and the trainer's",
        "forward run them in 64-row blocks (models/batch_invariant.py), so bf16 keeps engine and trainer bit-equal.",
        "",
    ]
    trainer, engine = results.get("trainer"), results.get("engine")
    if trainer or engine:
        lines += ["| role | fp32 | bf16 | bf16 / fp32 speed |", "| --- | ---: | ---: | ---: |"]
        if trainer:
            f, b = trainer["fp32"]["step_s"], trainer["bf16"]["step_s"]
            lines.append(f"| trainer: demo-shaped GRPO step (64 x 62 tokens), s | {f:.2f} | {b:.2f} | {f / b:.2f}x |")
        if engine:
            f, b = engine["fp32"]["tokens_per_s"], engine["bf16"]["tokens_per_s"]
            lines.append(f"| engine: decode, 64 sequences x 24 tokens, tokens/s | {f:.0f} | {b:.0f} | {b / f:.2f}x |")
        lines.append("")
    demos = results.get("demo")
    if demos:
        lines += [
            "`make demo`'s run (`examples/demo_smollm2.yaml`, 12 steps, SmolLM2 already converted) per precision:",
            "",
            "| --precision | ran | wall s | median step s | reward, first -> last 3 steps "
            "| held-out pass@1, 0 -> 12 steps |",
            "| --- | --- | ---: | ---: | --- | --- |",
        ]
        for p, d in demos.items():
            lines.append(f"| {p} | {d['chosen']} | {d['wall_s']:.0f} | {d['median_step_s']:.1f} | "
                         f"{d['reward_first3']:.2f} -> {d['reward_last3']:.2f} | "
                         f"{d['pass_first']:.3f} -> {d['pass_last']:.3f} |")  # fmt: skip
        if "fp32" in demos:
            base = demos["fp32"]["wall_s"]
            others = [(p, d) for p, d in demos.items() if p != "fp32"]
            lines += [""] + [f"- {p}: {base / d['wall_s']:.2f}x fp32's wall time" for p, d in others]
        if "auto" in demos:
            lines += ["", f"auto's line: `precision: {demos['auto']['chosen']} ({demos['auto']['reason']})`"]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="trainer,engine,demo")
    p.add_argument("--write", action="store_true", help="write the section of docs/benchmarks.md")
    p.add_argument("--child", choices=["trainer", "engine"], help=argparse.SUPPRESS)
    p.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        fn = child_trainer if args.child == "trainer" else child_engine
        print(json.dumps(fn(args.precision)))
        return
    parts = args.parts.split(",")
    results: dict = {}
    for part in ("trainer", "engine"):
        if part in parts:
            results[part] = {prec: in_child(part, prec) for prec in PRECISIONS}
            print(part, results[part], flush=True)
    if "demo" in parts:
        with tempfile.TemporaryDirectory(prefix="bench-precision-") as work:
            results["demo"] = {}
            for prec in ("auto", "fp32", "bf16"):
                results["demo"][prec] = demo(prec, Path(work))
                print("demo", prec, results["demo"][prec], flush=True)
    text = render(results)
    print(text)
    if args.write:
        bench_doc.write_section(text, SECTION)


if __name__ == "__main__":
    main()
