"""Linear layers whose weights are laid out once for oneDNN's CPU kernels, not on every call.

A decode step multiplies a few rows by each weight once. `F.linear` on CPU re-lays the weight out for its GEMM
kernel on every call, and at a decode step's 32 rows that costs about as much as the product itself. oneDNN can
take the weight already in its blocked layout (the ops torch's own compiler uses for frozen CPU models). SmolLM2,
32 rows, 30 layers' four products: fp32 106 -> 55 ms, bf16 41 -> 32 ms; the 49152 x 576 output layer fp32 31 ->
12 ms, bf16 10.5 -> 6.2 ms. Packing costs about 0.28 s (fp32) / 0.08 s (bf16) a weight load: a handful of
decode steps. The packed tensor is opaque (no views, no slicing), so the runner keeps it next to nothing else.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor


def pack(weight: Tensor) -> Tensor:
    """[out, in] weight -> oneDNN's blocked layout (valid for any number of input rows)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` for a weight that went through `pack`; x is [..., in]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """Whether this torch build has the ops and they compute F.linear here (checked once per dtype).

    The ops are torch internals: a build without oneDNN, or one that renamed them, falls back to F.linear.
    """
    if not torch.backends.mkldnn.is_available():
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g).to(dtype)
    x = torch.randn(3, 40, generator=g).to(dtype)
    b = torch.randn(24, generator=g).to(dtype)
    try:
        with torch.inference_mode():
            got = linear(x, pack(w), b)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    want = F.linear(x.float(), w.float(), b.float())
    tol = 1e-4 if dtype == torch.float32 else 0.1
    return got.shape == want.shape and bool((got.float() - want).abs().max() <= tol)
