"""How a bf16 model takes its fp32 masters' values after each optimizer step (--bf16-weight-rounding).

With bf16 compute AdamW updates fp32 masters and the model computes with their bf16 copies (tasks/train/optim.py).
bf16 keeps 8 significant bits: a weight of 0.2 sits on a grid of spacing 2^-10 (~1e-3), while an RL step at lr 1e-5
moves it by ~1e-5. Rounded to nearest, the copy of a weight that sits on the grid (a third of SmolLM2's) does not
change until its master has drifted half a spacing, ~50 steps at that lr: the bf16 model learns late.

`stochastic` rounds each weight up with probability equal to its position between its two bf16 neighbours, through
a random threshold fixed per weight at start (seeded; the same on every data-parallel rank): the bf16 copy follows
its master in expectation, with no dead zone at the grid points, and it is still a function of the masters alone,
so it does not jitter from step to step and a run resumed from its masters gets the same bf16 model. The masters
start on the bf16 grid (the checkpoint rounded to nearest, what the engines load), where stochastic rounding is
exact, so the first rollout and the trainer agree too. The engines
are sent the model's own bf16 weights (PolicyTrainer.write_weights), so they sample with exactly what the trainer
computes with. `nearest` is torch's round-to-nearest-even (megatron's scheme).
"""

from __future__ import annotations

import torch
from torch import Tensor

_LOW = (1 << 16) - 1  # the 16 bits of an fp32 that bf16 drops


def stochastic_bf16(x: Tensor, thresholds: Tensor) -> Tensor:
    """`x` (fp32) rounded to bf16, up (away from zero) where its dropped 16 bits plus `thresholds` (ints in
    [0, 2^16)) carry into the kept bits: with uniform thresholds, up with probability (dropped bits) / 2^16."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + thresholds.to(torch.int32)) & ~_LOW).view(torch.float32).to(torch.bfloat16)


class MasterRounding:
    """Rounds fp32 masters into a bf16 model: `mode` "nearest" or "stochastic" (see the module doc).

    The thresholds are one flat sequence over the parameters in named_parameters order (as zero.py lays them out),
    drawn once from `seed` and the tensor-parallel rank (each TP rank holds other shards), stored as int16."""

    def __init__(self, mode: str, numels: list[int], seed: int, tp_rank: int, device: torch.device):
        self.mode = mode
        self.offsets = [0]
        for n in numels:
            self.offsets.append(self.offsets[-1] + n)
        self.thresholds = None
        if mode == "stochastic":
            g = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * tp_rank + 17)
            drawn = torch.randint(-(1 << 15), 1 << 15, (self.offsets[-1],), dtype=torch.int16, generator=g)
            self.thresholds = drawn.to(device)

    def _flat_thresholds(self, lo: int, n: int) -> Tensor:
        t = self.thresholds[lo : lo + n].to(torch.int32) + (1 << 15)
        return t if t.numel() == n else torch.cat([t, t.new_zeros(n - t.numel())])  # zero.py's padding

    @torch.no_grad()
    def copy(self, params: list[Tensor], masters: list[Tensor]) -> None:
        """Each parameter `params[i]` takes the rounding of `masters[i]` (full tensors, named_parameters order)."""
        for i, (p, m) in enumerate(zip(params, masters)):
            if self.thresholds is None:
                p.copy_(m)
            else:
                p.copy_(stochastic_bf16(m.float(), self._flat_thresholds(self.offsets[i], m.numel()).view(m.shape)))

    @torch.no_grad()
    def copy_flat(self, dst: Tensor, src: Tensor, lo: int) -> None:
        """zero.py's shard: `dst` (bf16, flat) takes the rounding of `src` (fp32, flat), elements lo, lo + 1, ..."""
        if self.thresholds is None:
            dst.copy_(src)
        else:
            dst.copy_(stochastic_bf16(src, self._flat_thresholds(lo, src.numel())))
