"""Training throughput of sluiceway's trainer on one GPU: a SmolLM2-135M-shaped model (random weights, built from
its config: nothing to download), GRPO steps of 64 samples x 256 tokens, fp32 and bf16 (fp32 masters).

    python benchmarks/bench_gpu_train.py          # on a CUDA machine (tests/gpu/run_on_device.sh sets one up)

Prints the machine (`bench_doc.machine_line`: CPU, flags, GPU) and tokens/s per dtype; both go to the section
"Trainer on one GPU" of docs/benchmarks.md by hand (the GPU machine is not where the docs live).
"""

from __future__ import annotations

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
from sluiceway.models.zoo import resolve_checkpoint
from sluiceway.tasks.train.samples import TrainSample
from sluiceway.tasks.train.trainer import PolicyTrainer

SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)  # fmt: skip


def samples(rng: random.Random, n: int, prompt: int, response: int) -> list[TrainSample]:
    out = []
    for _ in range(n):
        p = [rng.randrange(3, 49152) for _ in range(prompt)]
        r = [rng.randrange(3, 49152) for _ in range(response)]
        out.append(TrainSample(p, r, [1] * len(r), rng.uniform(-1, 1), [-5.0] * len(r)))
    return out


def main() -> None:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(tmp)
        # A model directory also holds a tokenizer; the trainer never reads it: borrow tiny-llama's.
        tiny = resolve_checkpoint("tiny-llama", cache_dir=Path(tmp) / "cache")
        for f in tiny.iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                shutil.copy(f, tmp)
        print(f"Machine: {machine_line()}")  # GPU name and torch version included
        for bf16 in (False, True):
            for mb in (16, 64):
                training = TrainingConfig(global_batch_size=64, micro_batch_size=mb, lr=1e-6, bf16=bf16,
                                          hf_checkpoint=tmp)  # fmt: skip
                trainer = PolicyTrainer(Path(tmp), training, AlgorithmConfig(), temperature=1.0, pad_token_id=2,
                                        device="cuda")  # fmt: skip
                rng = random.Random(0)
                times = []
                for k in range(6):
                    batch = samples(rng, 64, 64, 192)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    trainer.train_rollout(batch, k)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                step = statistics.median(times[2:])  # the first steps warm up kernels and the allocator
                peak = torch.cuda.max_memory_allocated() / 2**30
                print(
                    f"{'bf16' if bf16 else 'fp32'} micro-batch {mb}: {step * 1000:.0f} ms/step, "
                    f"{64 * 256 / step:,.0f} tokens/s, peak {peak:.1f} GiB",
                    flush=True,
                )
                del trainer
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
