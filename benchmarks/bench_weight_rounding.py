"""What --bf16-weight-rounding stochastic adds to a bf16 optimizer step: the masters -> bf16 model copy of
SmolLM2-135M's shapes (tasks/train/weight_rounding.py), round to nearest against stochastic, median of --repeat.

Run it as an AVX2-only CPU too (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2): the rounding is integer
arithmetic, so both should cost about the same. `--write` puts the table into docs/benchmarks.md.

    .venv/bin/python benchmarks/bench_weight_rounding.py --write
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import bench_doc
import torch

from sluiceway.tasks.train.weight_rounding import MasterRounding

# SmolLM2-135M: 30 layers of q/k/v/o (576x576, 192x576 twice, 576x576), gate/up/down (1536x576 x3), 2 norms,
# the tied 49152x576 embedding and the final norm.
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536), (576,), (576,)]
SHAPES = [s for _ in range(30) for s in LAYER] + [(49152, 576), (576,)]


def timed(rounding: MasterRounding, params, masters, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        rounding.copy(params, masters)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    masters = [torch.randn(s, generator=g) * 0.05 for s in SHAPES]
    params = [torch.empty(s, dtype=torch.bfloat16) for s in SHAPES]
    numels = [m.numel() for m in masters]
    cpu = torch.device("cpu")
    t0 = time.perf_counter()
    stochastic = MasterRounding("stochastic", numels, seed=1234, tp_rank=0, device=cpu)
    draw = time.perf_counter() - t0
    nearest_s = timed(MasterRounding("nearest", numels, 1234, 0, cpu), params, masters, a.repeat)
    stochastic_s = timed(stochastic, params, masters, a.repeat)
    isa = os.environ.get("ATEN_CPU_CAPABILITY", "default")
    table = "\n".join([
        "| ATEN_CPU_CAPABILITY | parameters | nearest copy, s | stochastic copy, s | ratio | thresholds drawn, s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        f"| {isa} | {sum(numels) / 1e6:.1f}M | {nearest_s:.3f} | {stochastic_s:.3f} | {stochastic_s / nearest_s:.2f}x "
        f"| {draw:.2f} |",
    ])  # fmt: skip
    print(table)
    if a.write:
        section = (
            "## bf16 weight rounding: the cost of stochastic rounding per optimizer step (issue 31)\n\n"
            "`benchmarks/bench_weight_rounding.py`: the copy of fp32 masters into the bf16 model after each optimizer "
            f"step, SmolLM2-135M's shapes, median of {a.repeat}, {torch.get_num_threads()} torch threads.\n\n"
            + table
            + "\n"
        )
        bench_doc.write_section(section, section.split("\n", 1)[0], bench_doc.DOC)


if __name__ == "__main__":
    main()
