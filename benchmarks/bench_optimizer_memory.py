"""Optimizer memory per data-parallel rank, with and without `--use-distributed-optimizer` (issue 21).

For each precision (fp32; bf16 compute over fp32 masters) and each DP size, a gloo group of DP processes on this
machine builds the policy trainer, trains one optimizer step (so Adam's moments exist) and counts, on every rank,
the bytes of the optimizer-state tensors it holds: Adam's two moments and step counts, and the fp32 master weights
where they are separate from the model's weights (bf16). `PolicyTrainer.optimizer_state_bytes` counts them; this
script checks the count against the parameter count and reports it per rank. The figures depend only on the model's
parameter count and the layout, not on the machine or the batch, so a tiny model and one step show them.

    .venv/bin/python benchmarks/bench_optimizer_memory.py                      # tiny-llama, DP 1 2 4, about 1 min
    .venv/bin/python benchmarks/bench_optimizer_memory.py --model smollm2-135m-instruct --dp 1 2
    .venv/bin/python benchmarks/bench_optimizer_memory.py --write-doc          # also refresh docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch.multiprocessing as mp
from bench_doc import DOC, write_section  # benchmarks/ is the script's own directory

SECTION = "## Optimizer memory per DP rank: the distributed optimizer"  # + " (model)"


def _rank(rank: int, world: int, args: dict, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from sluiceway.infra.proc import loopback_collectives

    # The group's store is a file (no port to race for); the trainer joins the group made here.
    loopback_collectives()
    dist.init_process_group("gloo", store=dist.FileStore(str(Path(out, "store")), world), rank=rank, world_size=world)
    from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
    from sluiceway.models.zoo import load_tokenizer, resolve_checkpoint
    from sluiceway.tasks.train.samples import TrainSample
    from sluiceway.tasks.train.trainer import PolicyTrainer

    torch.set_num_threads(1)
    path = resolve_checkpoint(args["model"])
    tok = load_tokenizer(path)
    n = 2 * world  # one micro-batch of 2 samples per rank
    training = TrainingConfig(
        global_batch_size=n, micro_batch_size=2, lr=1e-5, bf16=args["bf16"], hf_checkpoint=str(path),
        use_distributed_optimizer=args["sharded"],
    )  # fmt: skip
    trainer = PolicyTrainer(path, training, AlgorithmConfig(), temperature=1.0, pad_token_id=tok.pad_token_id)
    prompt, response = tok.encode("What is 2 + 3?"), tok.encode(" The answer is 5")
    samples = [TrainSample(prompt, response, [1] * len(response), (-1.0) ** i, [0.0] * len(response)) for i in range(n)]
    trainer.train_rollout(samples, step=0)
    params = sum(p.numel() for p in trainer.model.parameters())
    result = {"rank": rank, "params": params, "optimizer_bytes": trainer.optimizer_state_bytes()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def measure(model: str, dp: int, bf16: bool, sharded: bool) -> list[dict]:
    """Every rank's {"rank", "params", "optimizer_bytes"} for one layout."""
    with tempfile.TemporaryDirectory() as out:
        args = {"model": model, "bf16": bf16, "sharded": sharded}
        mp.start_processes(_rank, args=(dp, args, out), nprocs=dp, start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(dp)]


def render(rows: list[dict], model: str) -> str:
    params = rows[0]["ranks"][0]["params"]
    lines = [
        f"{SECTION} ({model})",
        "",
        f"`benchmarks/bench_optimizer_memory.py`: {model} ({params:,} parameters), one gloo process per DP rank on "
        "this machine, one optimizer step, then every rank counts the bytes of the optimizer-state tensors it holds "
        "(`PolicyTrainer.optimizer_state_bytes`): Adam's two fp32 moments and step counts, and the fp32 master "
        "weights where they are separate from the model's weights (bf16 compute; in fp32 the weights are the "
        "masters). Weights and gradients are not counted (every rank holds all of them, with or without the flag). "
        "The counts depend only on the parameter count and the layout, not on the CPU.",
        "",
        "| precision | DP | `--use-distributed-optimizer` | bytes per rank | bytes a parameter | vs. DP=1 unsharded |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = next(x for x in rows if x["bf16"] == r["bf16"] and not x["sharded"] and x["dp"] == 1)
        per_rank = [x["optimizer_bytes"] for x in r["ranks"]]
        each = f"{per_rank[0]:,}" if len(set(per_rank)) == 1 else " / ".join(f"{b:,}" for b in per_rank)
        each += f" ({per_rank[0] / 2**20:.2f} MiB)" + (f" on each of {len(per_rank)}" if len(per_rank) > 1 else "")
        lines.append(
            f"| {'bf16' if r['bf16'] else 'fp32'} | {r['dp']} | {'yes' if r['sharded'] else 'no'} | {each} | "
            f"{max(per_rank) / params:.2f} | {max(per_rank) / base['ranks'][0]['optimizer_bytes']:.3f} |"
        )
    lines += [
        "",
        "Sharded, each rank keeps 1/DP of the masters and moments: 12/DP bytes a parameter with bf16 compute, 8/DP "
        "in fp32 (tasks/train/zero.py); the last shard is padded to the others' size (at most DP-1 elements). The "
        "cost is an all-gather of the updated weights after each step (in the model's dtype) and, at a checkpoint, "
        "a gather of the shards to DP rank 0, which writes the unsharded layout. Transient buffers are not in the "
        "table: the all-gather writes straight into the model's weights (views of one flat buffer), and publishing "
        "weights with bf16 compute gathers the fp32 masters in full for the length of the write.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", help="zoo name or HF directory")
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4], help="data-parallel sizes")
    ap.add_argument("--write-doc", action="store_true", help=f"write the section into {DOC}")
    args = ap.parse_args()
    rows = []
    for bf16 in (False, True):
        for sharded, sizes in ((False, [1, max(args.dp)]), (True, args.dp)):
            for dp in sizes:
                ranks = measure(args.model, dp, bf16, sharded)
                rows.append({"bf16": bf16, "sharded": sharded, "dp": dp, "ranks": ranks})
                print(json.dumps(rows[-1]), flush=True)
    for r in rows:  # the count is what the layout says: 12 (bf16) or 8 (fp32) bytes a parameter, over DP sharded
        params, per_param = r["ranks"][0]["params"], 12 if r["bf16"] else 8
        want = per_param * params / (r["dp"] if r["sharded"] else 1)
        assert all(abs(x["optimizer_bytes"] - want) / want < 0.01 for x in r["ranks"]), r
    text = render(rows, args.model)
    print(text)
    if args.write_doc:
        write_section(text, f"{SECTION} ({args.model})", DOC)


if __name__ == "__main__":
    main()
