"""CPU arithmetic whose result for one row does not depend on how many rows, or how long a row, it runs with.

The embedded engine computes a token one decode step at a time over a batch that changes every step; the trainer
computes the whole sequence at once. In bf16 the two agree bit for bit only where every operation gives a row
the same bits whatever shape surrounds it (issue 31, docs/algorithms.md "Train/inference mismatch"). Measured on
torch 2.13's CPU kernels (AVX-512 and AVX2):

- matrix products are row-invariant, except a single-row bf16 product with a long inner dimension on AVX-512
  (oneDNN takes another kernel at M = 1): `single_row_safe` runs such a row as two;
- attention depends on the key span: softmax runs a scalar loop for rows shorter than a vector and sums a row's
  tail apart, and the product of probabilities and values sums a short tail of keys in another order.
  `masked_attention` pads the keys to a multiple of 64 (masked, zero values): a row gets the same bits at any
  span, whether the engine's cache gives it 27 keys or the trainer's sequence 28;
- a sum over the last dimension of fewer rows than threads splits each row between the threads (another
  order): `row_sums` gives every row a thread's worth of company;
- the rest (norms, RoPE, SwiGLU, the scores' product) was found invariant as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

KEY_MULTIPLE = 64  # >= the widest vector (16 fp32 lanes) times the kernels' unrolling


def padded_span(n: int) -> int:
    """The key span attention computes over for n keys: n rounded up to a multiple of KEY_MULTIPLE."""
    return max(KEY_MULTIPLE, -(-n // KEY_MULTIPLE) * KEY_MULTIPLE)


def masked_attention(q: Tensor, k: Tensor, v: Tensor, forbidden: Tensor, scale: float) -> Tensor:
    """softmax(q k^T * scale, -inf where `forbidden`) v, the softmax in fp32; q [..., t, d], k and v [..., s, d]
    with the same leading dimensions, `forbidden` bool broadcastable to [..., t, s]. The keys are padded to
    `padded_span(s)` (forbidden, zero values), so a query row's bits do not depend on s. Every row must have a
    key it may attend to."""
    s = k.size(-2)
    pad = padded_span(s) - s
    if pad:
        k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        extra = torch.ones((*forbidden.shape[:-1], pad), dtype=torch.bool, device=forbidden.device)
        forbidden = torch.cat([forbidden.expand(*forbidden.shape[:-1], s), extra], dim=-1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    probs = torch.softmax(scores.masked_fill_(forbidden, float("-inf")), dim=-1)
    return torch.matmul(probs.to(v.dtype), v)


def row_sums(x: Tensor) -> Tensor:
    """x.sum(-1) for a 2-D x, the same bits for a row whatever the number of rows (fewer rows than torch's threads
    are padded with copies of the first, so the reduction runs one row a thread)."""
    threads = torch.get_num_threads()
    n = x.size(0)
    if 0 < n < threads:
        return torch.cat([x, x[:1].expand(threads - n, -1)]).sum(-1)[:n]
    return x.sum(-1)


def single_row_safe(x: Tensor) -> tuple[Tensor, bool]:
    """(x, False), or x with its one row repeated (True) when it holds a single row: a matrix product then takes
    the kernel it takes for a batch (the caller keeps row 0 of the result)."""
    if x.numel() != x.size(-1):
        return x, False
    return x.reshape(1, x.size(-1)).expand(2, -1), True
