"""Slot-based KV cache: one row of `max_len` positions per running sequence, reserved up front.

Shapes are [layers, slots, kv_heads, max_len, head_dim]. Sequences of different lengths join and leave at
any step; the scheduler keeps the running ones in slots 0..n-1 (moving the last one into a freed slot), so a
decode step reads the cache through views instead of gathering rows.

The storage is an anonymous memory map, not `torch.zeros`: its pages read as zeros and take memory only once
written, so an engine's resident size follows the positions its sequences have reached, not `slots x max_len`
(SmolLM2-135M: 94 MB a row of 2048 positions in fp32, 1.5 GB for 16 rows, of which a sampler whose requests
stay under 700 positions touches about a third). A slot's positions at one (layer, head) are contiguous, so
writing the first `length` of them touches only those pages; reads beyond a row's length (masked) map the
kernel's shared zero page.
"""

from __future__ import annotations

import math
import mmap

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    """A zero tensor whose pages are given memory when first written (and its map, which must outlive it)."""
    nbytes = max(1, math.prod(shape) * torch.empty((), dtype=dtype).element_size())
    buf = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape), buf


class SlotKVCache:
    def __init__(
        self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype = torch.float32
    ):
        self.slots = slots
        self.max_len = max_len
        self.shape, self.dtype = (layers, slots, kv_heads, max_len, head_dim), dtype
        self.clear()

    def clear(self) -> None:
        """Every position zero again, and the memory written so far given back (new maps, the old ones unmapped)."""
        self.k, self._k_map = lazy_zeros(self.shape, self.dtype)
        self.v, self._v_map = lazy_zeros(self.shape, self.dtype)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (compaction, or a shared prompt)."""
        if src != dst and length > 0:
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def nbytes(self) -> int:
        """The bytes reserved (the most the cache can take), not what it holds now."""
        return self.k.numel() * self.k.element_size() * 2
