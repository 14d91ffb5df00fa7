"""Activation recompute on CPU: peak memory and step time of a training step, with gradients compared (issue 21).

One fresh process per setting (Megatron's --recompute-granularity / --recompute-method / --recompute-num-layers):
SmolLM2-135M-Instruct (30 layers) built as the trainer builds it (models/megatron_gpt.py, fp32), fused AdamW over
its parameters, and two optimizer steps of one micro-batch each: ROWS rows of SEQ tokens, the log-probs and
entropy of the last RESPONSE positions of each row (what a policy loss reads), loss = -(advantage x log-prob) -
0.01 x entropy. Peak memory is the process's peak resident memory (VmHWM, reset after the model and optimizer
are built) less its resident memory after the imports: weights, gradients, Adam's moments (from the first step)
and the activations of the micro-batch. Measured twice: with glibc's default malloc settings (what a run gets),
and with MALLOC_MMAP_THRESHOLD_ fixed at 128 KiB, so that every tensor larger than that is its own mapping and
goes back to the system when freed (what the tensors themselves need). The plan's column is tasks/train/memory_plan.py's
prediction (its trainer rank peak without the process runtime). The first step's gradients of every setting are
compared with no recompute's, element by element. Time: the CPU time of the second step at one thread (CPU time,
not wall-clock: the machine's cores are shared).

    .venv/bin/python benchmarks/bench_recompute.py                # about 12 min on 2 cores
    .venv/bin/python benchmarks/bench_recompute.py --write-doc    # also refresh docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench_doc import DOC, write_section  # noqa: E402  (benchmarks/ is the script's own directory)
from peak_memory import MIB, peak, reset_peak, rss, run_child

SECTION = "## Activation recompute on CPU: peak memory and step time (smollm2-135m-instruct)"
SETTINGS = {
    "none": (None, None, None),
    "selective": ("selective", None, None),
    "full, uniform 1": ("full", "uniform", 1),
    "full, block 15": ("full", "block", 15),
}


def child(args) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from transformers import AutoConfig

    from sluiceway.models.hf_megatron import load_hf_weights
    from sluiceway.models.megatron_gpt import build_gpt_model, init_parallel_state, recompute_overrides
    from sluiceway.models.megatron_logprobs import token_logprobs_and_entropy
    from sluiceway.models.zoo import load_hf_state_dict, resolve_checkpoint
    from sluiceway.tasks.train.memory_model import PROCESS_RUNTIME, Layout, Recompute
    from sluiceway.tasks.train.memory_plan import plan

    torch.set_num_threads(1)
    base = rss()
    granularity, method, num_layers = SETTINGS[args.setting]
    settings = argparse.Namespace(recompute_granularity=granularity, recompute_method=method,
                                  recompute_num_layers=num_layers)  # fmt: skip
    init_parallel_state()
    path = resolve_checkpoint(args.model)
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    torch.manual_seed(0)
    model = build_gpt_model(hf_config, **recompute_overrides(settings)).train()
    load_hf_weights(model, load_hf_state_dict(path), hf_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, hf_config.vocab_size, (args.rows, args.seq), generator=g)
    needed = torch.zeros(args.rows, args.seq - 1, dtype=torch.bool)
    needed[:, -args.response :] = True
    advantage = torch.linspace(-1.0, 1.0, args.rows).unsqueeze(1)
    n = float(needed.sum())
    reset_peak()
    times = []
    for step in range(2):
        t0 = time.process_time()
        logp, entropy = token_logprobs_and_entropy(model, ids, 1.0, needed=needed)
        loss = -((advantage * logp + 0.01 * entropy) * needed).sum() / n
        loss.backward()
        if step == 0:
            torch.save({k: p.grad for k, p in model.named_parameters()}, args.grads)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.process_time() - t0)
    layout = Layout(rows=args.rows, seq=args.seq, loss_tokens=args.rows * args.response, micro_batches=1,
                    recompute=Recompute(granularity, method, num_layers))  # fmt: skip
    planned = plan(json.loads((path / "config.json").read_text()), layout).rank_peak - PROCESS_RUNTIME
    print(json.dumps({"peak": peak() - base, "step_s": times[1], "plan": planned,
                      "loss": float(loss)}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--write-doc", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--setting", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--grads", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    import torch

    shape = ["--model", args.model, "--rows", str(args.rows), "--seq", str(args.seq), "--response", str(args.response)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in SETTINGS:
            grads = str(Path(tmp) / f"{name.replace(' ', '_').replace(',', '')}.pt")
            results[name] = run_child(Path(__file__), [*shape, "--setting", name, "--grads", grads], threads=1)
            fixed = run_child(Path(__file__), [*shape, "--setting", name, "--grads", grads + ".2"], threads=1,
                              env={"MALLOC_MMAP_THRESHOLD_": "131072"})  # fmt: skip
            results[name]["peak_fixed"] = fixed["peak"]
            reference = torch.load(Path(tmp) / "none.pt")
            mine = torch.load(grads)
            results[name]["grad_diff"] = max(float((mine[k] - v).abs().max()) for k, v in reference.items())
            del reference, mine
            print(name, results[name], flush=True)
    text = render(results, args)
    print(text)
    if args.write_doc:
        write_section(text, SECTION, DOC)
        print(f"wrote {DOC}", file=sys.stderr)


def render(results: dict[str, dict], args) -> str:
    base = results["none"]
    lines = [
        SECTION,
        "",
        f"`benchmarks/bench_recompute.py`: {args.model} (30 layers) in fp32 as the trainer builds it, fused AdamW, "
        f"one micro-batch of {args.rows} rows x {args.seq} tokens per optimizer step (log-probs and entropy at the "
        f"last {args.response} positions of each row), two steps, each setting in a fresh process at one thread. "
        "Peak = peak resident memory (VmHWM) less the resident memory after the imports, with glibc's default "
        "malloc settings (what a run gets) and with MALLOC_MMAP_THRESHOLD_=131072 (every tensor over 128 KiB its "
        "own mapping, returned when freed: what the tensors need); plan = tasks/train/memory_plan.py's prediction. "
        "Gradients: the largest absolute difference of any element of the first step's gradients from those without "
        "recompute. Step: the CPU time of the second optimizer step (forward, backward, AdamW).",
        "",
        "| recompute | peak MiB (default malloc) | vs none | peak MiB (128 KiB mmap threshold) | vs none | plan MiB "
        "| step CPU s | vs none | max grad diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['peak'] / MIB:,.0f} | {r['peak'] / base['peak']:.2f}x | {r['peak_fixed'] / MIB:,.0f} | "
            f"{r['peak_fixed'] / base['peak_fixed']:.2f}x | {r['plan'] / MIB:,.0f} | {r['step_s']:.1f} | "
            f"{r['step_s'] / base['step_s']:.2f}x | {r['grad_diff']:.1e} |"
        )
    lines += [
        "",
        "Full recompute keeps each layer's input through forward and rebuilds the activations in backward: "
        "uniform 1 one layer at a time (the smallest peak, for about one more forward pass of compute), block 15 "
        "the first 15 layers one at a time while the other 15 keep theirs. Selective recomputes the core attention "
        "only: in fp32 on CPU that is SDPA's flash kernel, which keeps just q, k, v, its output and a log-sum-exp, "
        "so there is nothing to save (selective pays where attention keeps its softmax: the explicit bf16 "
        "attention of short rows on CPU, or long rows with eager attention); its peak under glibc's default "
        "malloc varies from run to run (one earlier run of this script: 18% above none's). The two peak columns "
        "differ by what glibc keeps of "
        "freed memory: with its default (dynamic) mmap threshold, tensors of a few MiB come from the heap and are "
        "not all given back; tasks/train/memory_plan.py predicts the tensors (here one micro-batch a step: gradients "
        "appear as backward frees the activations). On CPU megatron's checkpoint function needs CPU-only RNG helpers "
        "(models/megatron_gpt.py); the gradients are the same bits here and in tests/unit/models/test_recompute.py "
        "(with attention dropout on, so the replay's dropout masks are checked too).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
