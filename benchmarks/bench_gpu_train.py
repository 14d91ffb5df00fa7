"""Training throughput of sluiceway's trainer on one GPU at three model shapes (random weights, built from their
configs: nothing to download), GRPO steps, bf16 over fp32 master weights, one optimizer step per rollout:

    smollm2-135m   64 samples x 256 tokens (64 prompt + 192 response), micro-batch 64
    qwen2.5-0.5b   64 samples x 1,024 tokens (128 + 896), micro-batch 8 (Qwen2.5-0.5B's shape, Llama-typed)
    qwen2.5-1.5b   64 samples x 1,024 tokens (128 + 896), micro-batch 8

    python benchmarks/bench_gpu_train.py [--shape NAME ...] [--profile] [--recompute-layers N] [--eager-layers]
                                         [--json PATH]

tests/gpu/run_on_device.sh sets a machine up. Per shape: ms/step (median of the steps after two warm ones),
tokens/s, model FLOP/s as 6 x parameters x tokens / step time (attention ignored) and its share of the card's
dense bf16 peak (989 TFLOP/s: H100 SXM; --peak-tflops for another card), and the torch allocator's peak memory.
`--profile` adds one profiled step: the share of its wall time the GPU was busy, the host's synchronisations
(cudaStreamSynchronize and the like) and kernel launches. `--recompute-layers N`: megatron's full recompute of the
first N layers (method block), to trade compute for memory. `--eager-layers`: the transformer layers not
compiled (models/megatron_gpt.py compiles them on GPUs), the A/B of that change. Results go to docs/benchmarks.md
("Trainer on one GPU") by hand, with the machine line printed first (the GPU machine is not where the docs live).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_doc import machine_line  # benchmarks/ is the script's own directory
from transformers import LlamaConfig, LlamaForCausalLM

from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
from sluiceway.models.megatron_gpt import compile_layers_on
from sluiceway.models.zoo import resolve_checkpoint
from sluiceway.tasks.train.trainer import PolicyTrainer

try:
    from sluiceway.tasks.train.samples import TrainSample
except ImportError:  # where TrainSample still lives in batch.py (it moves to a storage-free module)
    from sluiceway.tasks.train.batch import TrainSample

_COMMON = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
# name: (config, samples, prompt tokens, response tokens, micro-batch)
SHAPES = {
    "smollm2-135m": (dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                          rope_theta=100000.0, rms_norm_eps=1e-5), 64, 64, 192, 64),
    "qwen2.5-0.5b": (dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                          rope_theta=1e6, rms_norm_eps=1e-6), 64, 128, 896, 8),
    "qwen2.5-1.5b": (dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                          num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096,
                          rope_theta=1e6, rms_norm_eps=1e-6), 64, 128, 896, 8),
}  # fmt: skip
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernelEx",
    "cudaLaunchCooperativeKernel",
)


def samples(rng: random.Random, n: int, prompt: int, response: int, vocab: int) -> list[TrainSample]:
    out = []
    for _ in range(n):
        p = [rng.randrange(3, vocab) for _ in range(prompt)]
        r = [rng.randrange(3, vocab) for _ in range(response)]
        out.append(TrainSample(p, r, [1] * len(r), rng.uniform(-1, 1), [-5.0] * len(r)))
    return out


def model_dir(tmp: str, config: dict) -> int:
    """A random-weight checkpoint of `config` in `tmp` (bf16 on disk: the trainer's masters start from it either
    way), with tiny-llama's tokenizer files (never read by the trainer); returns the parameter count."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**_COMMON, **config))
    params = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(tmp)
    del model
    tiny = resolve_checkpoint("tiny-llama", cache_dir=Path(tmp) / "cache")
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, tmp)
    return params


def profile_step(trainer: PolicyTrainer, batch: list[TrainSample], step: int) -> dict[str, float]:
    """One step under torch.profiler: its wall time, the GPU's busy time (kernels, copies and sets: one stream, so
    they do not overlap), the host's synchronisations and kernel launches."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        trainer.train_rollout(batch, step)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    syncs = sum(e.count for e in events if e.key in SYNC_CALLS)
    launches = sum(e.count for e in events if e.key in LAUNCH_CALLS)
    top = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: -e.self_device_time_total)[:25]  # fmt: skip
    kernels = [(e.key[:100], e.count, e.self_device_time_total / 1e6) for e in top]
    return {"profiled_wall_s": wall, "busy_s": busy, "busy_share": busy / wall, "syncs": syncs,
            "launches": launches, "top_kernels": kernels}  # fmt: skip


def run_shape(name: str, steps: int, profile: bool, recompute_layers: int, peak_tflops: float) -> dict:
    config, n, prompt, response, mb = SHAPES[name]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        params = model_dir(tmp, config)
        recompute = ({"recompute_granularity": "full", "recompute_method": "block",
                      "recompute_num_layers": recompute_layers} if recompute_layers else {})  # fmt: skip
        training = TrainingConfig(global_batch_size=n, micro_batch_size=mb, lr=1e-6, bf16=True, hf_checkpoint=tmp,
                                  **recompute)  # fmt: skip
        trainer = PolicyTrainer(Path(tmp), training, AlgorithmConfig(), temperature=1.0, pad_token_id=2,
                                device="cuda")  # fmt: skip
        setup = time.perf_counter() - t0
        rng = random.Random(0)
        times = []
        torch.cuda.reset_peak_memory_stats()
        for k in range(steps):
            batch = samples(rng, n, prompt, response, config["vocab_size"])
            torch.cuda.synchronize()
            t = time.perf_counter()
            trainer.train_rollout(batch, k)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        step = statistics.median(times[2:])  # the first steps compile, warm up kernels and the allocator
        tokens = n * (prompt + response)
        tflops = 6 * params * tokens / step / 1e12
        out = {"shape": name, "params": params, "samples": n, "tokens_per_sample": prompt + response,
               "micro_batch": mb, "recompute_layers": recompute_layers,
               "compiled_layers": compile_layers_on(torch.device("cuda")), "setup_s": round(setup, 1),
               "steps_ms": [round(1000 * t) for t in times], "ms_per_step": 1000 * step, "tokens_per_s": tokens / step,
               "model_tflops": tflops, "peak_share": tflops / peak_tflops,
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip
        if profile:
            out |= profile_step(trainer, samples(rng, n, prompt, response, config["vocab_size"]), steps)
        del trainer
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", choices=list(SHAPES), help="default: all three")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--recompute-layers", type=int, default=0)
    parser.add_argument(
        "--eager-layers",
        action="store_true",
        help="transformer layers not compiled (SLUICEWAY_COMPILE_LAYERS=0): the A/B of issue 44",
    )
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--json", type=Path, help="append each shape's result here, one JSON object a line")
    args = parser.parse_args()
    if args.eager_layers:
        os.environ["SLUICEWAY_COMPILE_LAYERS"] = "0"
    print(f"Machine: {machine_line()}", flush=True)  # GPU name and torch version included
    for name in args.shape or list(SHAPES):
        r = run_shape(name, args.steps, args.profile, args.recompute_layers, args.peak_tflops)
        variant = " eager layers" if args.eager_layers else " compiled layers"
        variant += f" recompute {args.recompute_layers} layers" if args.recompute_layers else ""
        line = (f"{name} bf16 mb {r['micro_batch']}{variant}: {r['ms_per_step']:.0f} ms/step, "
                f"{r['tokens_per_s']:,.0f} tokens/s, {r['model_tflops']:.0f} TFLOP/s = {100 * r['peak_share']:.1f}% "
                f"of bf16 peak, peak {r['peak_gib']:.1f} GiB (steps {r['steps_ms']} ms)")  # fmt: skip
        if args.profile:
            line += (f"; profiled step {r['profiled_wall_s']:.2f} s, GPU busy {100 * r['busy_share']:.0f}%, "
                     f"{r['syncs']} syncs, {r['launches']:,} kernel launches")  # fmt: skip
        print(line, flush=True)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
