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

On a CPU with AMX (issue 51) oneDNN's bf16 products are not row-invariant: its brgemm kernels block the inner
dimension by the number of rows, so a SmolLM2-wide row (576 or 1536 inner) gets other bits at 16 or 32 rows
than at 64-128, and others again at 256 or more, with 1 thread as with 2 (measured on a 2-core Xeon with
amx_bf16, torch 2.13's oneDNN; products with an inner dimension of 256 or less were invariant). A call of
exactly `ROW_BLOCK` rows gives a row the same bits wherever it sits in the block and at any thread count, so
there `stable_linear` runs every bf16 product in such calls (the last one padded): the engine's decode rows, its
prefills and the trainer's forward take the same kernel. `rows_vary` tells, by measuring, whether this process
needs it; on CPUs without AMX it says no and nothing changes (or costs anything).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

KEY_MULTIPLE = 64  # >= the widest vector (16 fp32 lanes) times the kernels' unrolling
# Rows per bf16 product where rows vary: 64 rows ran SmolLM2's products at 650-740 GFLOP/s on the AMX Xeon (2
# threads; fp32 240-310, one unblocked 2,048-row product 900-2,400), and a decode step padded to 64 rows still ran
# faster than fp32 at 4-32 rows. Fewer rows per call was slower for training; more, slower for decode.
ROW_BLOCK = 64


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


@functools.cache
def rows_vary(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a row's CPU product in `dtype` depends on how many rows run with it (as on AMX: module docstring).
    Measured once per process at SmolLM2's q/k/v shape (a few small products, about 10 ms). A lone row is not
    asked about: `single_row_safe` covers the kernel AVX-512 takes for it."""
    if dtype == torch.float32:
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1728, 576, generator=g).to(dtype)
    x = torch.randn(4 * ROW_BLOCK, 576, generator=g).to(dtype)
    with torch.inference_mode():
        block = F.linear(x[:ROW_BLOCK], w)
        return not all(torch.equal(F.linear(x[:m], w), block[:m]) for m in (2, 16, 32)) or not torch.equal(
            F.linear(x, w)[:ROW_BLOCK], block
        )


def stable_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, product=F.linear) -> Tensor:
    """`product(x, weight, bias)` (F.linear's contract, x [..., in]) computed `ROW_BLOCK` rows at a time, the last
    block padded with zero rows: each row gets the bits it gets in any other batch. `product` may be another
    function of the same contract (the engine's packed weights)."""
    rows = x.reshape(-1, x.size(-1))
    n = rows.size(0)
    if n == 0:
        return product(x, weight, bias)
    full = n - n % ROW_BLOCK
    tail = rows[full:]
    if tail.size(0):  # the last block, padded with zero rows: computed apart, so the result holds exactly n rows
        tail = product(F.pad(tail, (0, 0, 0, ROW_BLOCK - tail.size(0))), weight, bias)[: tail.size(0)]
    if product is F.linear and weight.dim() == 2:
        # Straight into one output (F.linear's own mm/addmm, the same bits): 10-15% faster than a cat of blocks.
        out = rows.new_empty(n, weight.size(0))
        wt = weight.t()
        for a in range(0, full, ROW_BLOCK):
            block, dst = rows[a : a + ROW_BLOCK], out[a : a + ROW_BLOCK]
            torch.mm(block, wt, out=dst) if bias is None else torch.addmm(bias, block, wt, out=dst)
        if full < n:
            out[full:] = tail
    else:
        blocks = [product(block, weight, bias) for block in rows[:full].split(ROW_BLOCK)]
        out = torch.cat(blocks + ([tail] if full < n else []))
    return out.reshape(*x.shape[:-1], out.size(-1))

class RowBlockLinear(torch.autograd.Function):
    """F.linear(x, weight, bias) whose forward is `stable_linear` and whose backward is the plain product's
    (grad x = g W, all-reduced over `tp_group` when given; grad weight = g^T x; grad bias = sum of g), so only the
    forward's bits change. The trainer's linear layers on CPUs where rows vary (models/megatron_row_blocks.py)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None = None, tp_group=None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.use_bias, ctx.tp_group = bias is not None, tp_group
        return stable_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        if grad_x is not None and ctx.tp_group is not None:
            torch.distributed.all_reduce(grad_x, group=ctx.tp_group)
        g2 = grad.reshape(-1, grad.size(-1))
        grad_w = g2.t().matmul(x.reshape(-1, x.size(-1))) if ctx.needs_input_grad[1] else None
        grad_b = g2.sum(dim=0) if ctx.use_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None
