"""Slot-based KV cache: one preallocated row of `max_len` positions per running sequence.

Shapes are [layers, slots, kv_heads, max_len, head_dim]. Sequences of different lengths join and leave at
any step; the scheduler keeps the running ones in slots 0..n-1 (moving the last one into a freed slot), so a
decode step reads the cache through views instead of gathering rows.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    def __init__(
        self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype = torch.float32
    ):
        self.slots = slots
        self.max_len = max_len
        shape = (layers, slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (compaction, or a shared prompt)."""
        if src != dst and length > 0:
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
