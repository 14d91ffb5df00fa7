"""Embedded engine (continuous batching) vs transformers `model.generate`, same model, batch, dtype, machine.

RL-style workload: a rollout step is a stream of requests (prompts x samples) larger than the batch the
generator runs at once. Here: --requests chat-templated arithmetic questions with mixed response lengths
(request i is given its own max_new_tokens, spread from --min-new to --max-new, EOS ignored so the lengths are
exact and identical for both sides), at an equal batch of --batch sequences:
- transformers generates consecutive batches of --batch requests, each until its longest row ends (finished
  rows stay in the batch, new requests wait for the next batch);
- the engine runs at most --batch requests at once and admits a waiting request whenever a row finishes.
Both sample at T=0.7 without truncation. Throughput counts the requested tokens (sum of max_new_tokens) over
the wall time from the first submit to the last token, prefill included.

    .venv/bin/python benchmarks/bench_engine.py                 # smollm2-135m-instruct, 128 requests, batch 32
    .venv/bin/python benchmarks/bench_engine.py --tiny          # tiny-llama (seconds; for a smoke run)
    .venv/bin/python benchmarks/bench_engine.py --write-doc     # also refresh the section in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from pathlib import Path

import torch
from bench_doc import DOC, write_section  # noqa: E402  (benchmarks/ is the script's own directory)

from sluiceway.models.engine import Engine, GenerateRequest, SamplingParams
from sluiceway.models.engine.core import dtype_from_name
from sluiceway.models.zoo import load_hf_model, load_tokenizer, resolve_checkpoint

SECTION = "## Embedded engine vs transformers generate"


def prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        msgs = [{"role": "user", "content": f"What is {a} + {b}? Think step by step, then give the answer."}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def lengths(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed + 1)
    return [rng.randint(lo, hi) for _ in range(n - 1)] + [hi]  # the longest one is always there


def bench_engine(path: Path, dtype: torch.dtype, ps: list[list[int]], ls: list[int], batch: int) -> tuple[float, dict]:
    engine = Engine(path, max_running_requests=batch, max_total_len=max(map(len, ps)) + max(ls) + 1, dtype=dtype)
    try:
        engine.generate([GenerateRequest(ps[0], SamplingParams(max_new_tokens=4))])  # warm-up
        reqs = [
            GenerateRequest(p, SamplingParams(max_new_tokens=n, temperature=0.7, sampling_seed=i, ignore_eos=True))
            for i, (p, n) in enumerate(zip(ps, ls, strict=True))
        ]
        t0 = time.perf_counter()
        outs = engine.generate(reqs)
        elapsed = time.perf_counter() - t0
        assert [len(o.output_ids) for o in outs] == ls
        return elapsed, engine.load()
    finally:
        engine.shutdown()


def _left_padded(ps: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, ps))
    ids = torch.full((len(ps), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(ps):  # left padding, as generation needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


@torch.inference_mode()
def bench_transformers(
    path: Path, dtype: torch.dtype, ps: list[list[int]], ls: list[int], pad_id: int, batch: int
) -> float:
    model = load_hf_model(path, dtype=dtype)
    kw = dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0, pad_token_id=pad_id)
    ids, mask = _left_padded(ps[:1], pad_id)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, **kw)  # warm-up
    torch.manual_seed(0)
    t0 = time.perf_counter()
    for start in range(0, len(ps), batch):
        ids, mask = _left_padded(ps[start : start + batch], pad_id)
        longest = max(ls[start : start + batch])
        # No EOS: every row runs to the batch's longest length, which is what a batch with one long row costs.
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, eos_token_id=None, **kw)
        assert out.shape[1] - ids.shape[1] == longest
    return time.perf_counter() - t0


def write_doc(text: str) -> None:
    write_section(text, SECTION, DOC)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tiny", action="store_true", help="use tiny-llama (fallback when SmolLM2 is unavailable)")
    ap.add_argument("--batch", type=int, default=32, help="sequences generated at once (both generators)")
    ap.add_argument("--requests", type=int, default=128, help="requests in the rollout (a multiple of --batch)")
    ap.add_argument("--min-new", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--write-doc", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    name = "tiny-llama" if args.tiny else args.model
    path = resolve_checkpoint(name)
    dtype = dtype_from_name(args.dtype)
    tok = load_tokenizer(path)
    ps = prompts(tok, args.requests)
    ls = lengths(args.requests, args.min_new, args.max_new)
    useful = sum(ls)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    t_hf = bench_transformers(path, dtype, ps, ls, pad, args.batch)
    t_en, load = bench_engine(path, dtype, ps, ls, args.batch)
    hf_tps, en_tps = useful / t_hf, useful / t_en
    lines = [
        SECTION,
        "",
        f"`benchmarks/bench_engine.py` ({time.strftime('%Y-%m-%d')}): model `{name}`, dtype {args.dtype}, "
        f"{args.requests} requests at a batch of {args.batch}, chat-templated arithmetic prompts "
        f"({min(map(len, ps))}-{max(map(len, ps))} tokens), "
        f"response lengths {args.min_new}-{args.max_new} (mean {useful / len(ls):.0f}; {useful} tokens in all), "
        f"T=0.7; {platform.machine()} CPU, {torch.get_num_threads()} torch threads, torch {torch.__version__}.",
        "",
        "| generator | wall s | new tokens/s |",
        "| --- | ---: | ---: |",
        f"| transformers `generate` (consecutive batches of {args.batch}, each to its longest row) "
        f"| {t_hf:.1f} | {hf_tps:.1f} |",
        f"| embedded engine (continuous batching) | {t_en:.1f} | {en_tps:.1f} |",
        "",
        f"Ratio engine / transformers: **{en_tps / hf_tps:.2f}x** (one run each, same machine). "
        f"Engine: {load['decode_steps']} decode steps, at most {load['max_running_requests_seen']} running.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write_doc:
        write_doc(text)


if __name__ == "__main__":
    main()
