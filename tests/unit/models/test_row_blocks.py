"""Row blocks (issue 51): where a CPU's bf16 products vary with their row count (AMX), every product runs in calls
of ROW_BLOCK rows. A row then gets the same bits in any batch, and the trainer's gradients stay the plain
product's. The engine-trainer agreement itself: tests/unit/train/test_bf16_agreement.py."""

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sluiceway.models.batch_invariant import ROW_BLOCK, RowBlockLinear, rows_vary, stable_linear


def amx_unlimited() -> bool:
    try:
        has = "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return has and not os.environ.get("ONEDNN_MAX_CPU_ISA")


def data(rows: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(1728, 576, generator=g) * 0.05).to(dtype)
    return torch.randn(rows, 576, generator=g).to(dtype), w, torch.randn(1728, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_gets_the_same_bits_in_any_batch(dtype):
    x, w, b = data(3 * ROW_BLOCK + 7, dtype)
    whole = stable_linear(x, w, b)
    assert whole.shape == (x.size(0), w.size(0))
    other = lambda *a: F.linear(*a)  # noqa: E731  (another product: the engine's packed weights take this path)
    for start, n in ((0, 1), (5, 2), (9, 16), (30, 33), (1, ROW_BLOCK), (3, 2 * ROW_BLOCK), (3, 2 * ROW_BLOCK + 5)):
        for product in (F.linear, other):
            part = stable_linear(x[start : start + n], w, b, product)
            assert torch.equal(part, whole[start : start + n]), (start, n, product)
    # Leading dimensions are kept, as F.linear keeps them.
    assert torch.equal(stable_linear(x[:12].view(3, 4, -1), w, b), whole[:12].view(3, 4, -1))
    torch.testing.assert_close(whole.float(), F.linear(x, w, b).float(), atol=0.05 if dtype != torch.float32 else 1e-4,
                               rtol=0.02)  # fmt: skip


def test_the_result_keeps_no_padding():
    """A padded block's extra rows are not kept alive by the result (autograd may save it: a [rows, vocab] logits
    tensor padded to the block would hold up to 63 rows more)."""
    x, w, b = data(ROW_BLOCK + 5, torch.bfloat16)
    for product in (F.linear, lambda *a: F.linear(*a)):  # F.linear's own path, and another product's
        out = stable_linear(x, w, b, product)
        assert out.untyped_storage().nbytes() == out.numel() * out.element_size()


def test_an_empty_batch_is_an_empty_product():
    x, w, b = data(0, torch.bfloat16)
    assert stable_linear(x, w, b).shape == (0, w.size(0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gradients_are_the_plain_products(dtype):
    """Backward is F.linear's arithmetic (megatron's: g W, g^T x, sum of g): the trainer's gradients keep their bits."""
    x, w, b = data(2 * ROW_BLOCK + 10, dtype)
    x = x.view(-1, 3, 576)  # [s, b, h], as megatron's layers take it
    got = [t.clone().requires_grad_(True) for t in (x, w, b)]
    want = [t.clone().requires_grad_(True) for t in (x, w, b)]
    g = torch.randn(*x.shape[:-1], w.size(0), generator=torch.Generator().manual_seed(4)).to(dtype)
    RowBlockLinear.apply(*got).backward(g)
    # megatron's backward, written out: the input's gradient g W, the weight's g^T x over all rows, the bias' sum.
    out = torch.matmul(want[0], want[1].t()) + want[2]
    out.backward(g)
    torch.testing.assert_close(got[0].grad, g.matmul(w), atol=0, rtol=0)
    torch.testing.assert_close(got[1].grad, g.reshape(-1, w.size(0)).t().matmul(x.reshape(-1, 576)), atol=0, rtol=0)
    torch.testing.assert_close(got[2].grad, g.reshape(-1, w.size(0)).sum(0), atol=0, rtol=0)
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine.grad.float(), theirs.grad.float(), atol=0.05, rtol=0.02)


def test_rows_vary_where_amx_runs():
    """Measured, not read from the flags: AMX varies; fp32 never asks."""
    assert rows_vary(torch.float32) is False
    if amx_unlimited():
        assert rows_vary(torch.bfloat16) is True
        x, w, _ = data(ROW_BLOCK, torch.bfloat16)
        assert not torch.equal(F.linear(x[:16], w), F.linear(x, w)[:16])  # why: the kernel blocks by row count
