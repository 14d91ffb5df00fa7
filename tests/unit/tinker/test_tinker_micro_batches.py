"""A Tinker forward_backward in micro-batches (flows/tinker/model.py, issue 52 point 9): the same outputs and the
same accumulated gradient as one batch, with one micro-batch's activations alive at a time; a datum failing in a
later micro-batch takes back what the earlier ones added."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("tinker")
from sluiceway.flows.tinker.futures import TinkerUserError  # noqa: E402
from sluiceway.flows.tinker.model import TinkerModel, micro_batches  # noqa: E402
from sluiceway.flows.tinker.wire import DatumIn  # noqa: E402


def test_micro_batches_keep_order_and_the_budget():
    assert micro_batches([3, 3, 3, 3], 6) == [[0, 1], [2, 3]]
    assert micro_batches([2, 9, 2], 8) == [[0], [1], [2]]  # a datum longer than the budget goes alone
    assert micro_batches([1, 4, 1, 1], 8) == [[0, 1], [2, 3]]  # 3 x 4 > 8
    assert micro_batches([5] * 3, 10**6) == [[0, 1, 2]]


def data(n: int = 6) -> list[DatumIn]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        toks = rng.integers(3, 200, size=5 + 3 * i).tolist()
        out.append(DatumIn(toks[:-1], {"target_tokens": np.array(toks[1:]), "weights": np.ones(len(toks) - 1)}))
    return out


def grads(m: TinkerModel) -> list[torch.Tensor]:
    return [p.grad.clone() for p in m.trainer.trainable.parameters() if p.grad is not None]


def test_micro_batched_forward_backward_equals_one_batch(tiny):
    path, _ = tiny
    m = TinkerModel("s:train:0", path, lora_rank=0, seed=1, device="cpu")
    one, metrics_one = m.forward_backward(data(), "cross_entropy", {}, forward_only=False)
    g_one = grads(m)
    for p in m.trainer.trainable.parameters():
        p.grad = None
    m.micro_batch_tokens = 24  # two or three datums a micro-batch here
    many, metrics_many = m.forward_backward(data(), "cross_entropy", {}, forward_only=False)
    assert len(micro_batches([len(d.tokens) for d in data()], 24)) >= 3
    assert metrics_many["loss:sum"] == pytest.approx(metrics_one["loss:sum"], rel=1e-5)
    for a, b in zip(one, many):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=1e-5, atol=1e-6)
    g_many = grads(m)
    assert len(g_many) == len(g_one) > 0
    for a, b in zip(g_one, g_many):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

    # A datum whose loss is not finite, in the last micro-batch: the earlier ones' gradient is taken back.
    bad = data()
    bad[-1].inputs["logprobs"] = np.full(len(bad[-1].tokens), -1e30)
    bad[-1].inputs["advantages"] = np.ones(len(bad[-1].tokens))
    for d in bad[:-1]:
        d.inputs["logprobs"], d.inputs["advantages"] = np.zeros(len(d.tokens)), np.ones(len(d.tokens))
    for d in bad:
        d.inputs.pop("weights")
    with pytest.raises(TinkerUserError, match="datum 5: its importance_sampling loss is not finite"):
        m.forward_backward(bad, "importance_sampling", {}, forward_only=False)
    for a, b in zip(g_many, grads(m)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
