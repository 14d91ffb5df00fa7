"""Transformer layers under torch.compile (`compile_layers`, what `build_gpt_model` does on GPUs, issue 44): the
same logits and gradients as the eager layers, each layer one graph (no graph break in megatron's linear layers),
recompiled once for a new length and then reused. Checked here with inductor's CPU backend; CUDA's in tests/gpu."""

from __future__ import annotations

import pytest
import torch
from model_helpers import tiny_hf_model

import sluiceway.models.megatron_gpt as mg
import sluiceway.models.megatron_logprobs as mlp
from sluiceway.models.hf_megatron import load_hf_weights

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _step(model, ids):
    for p in model.parameters():
        p.grad = None
    logits = mlp.gpt_logits(model, ids)
    logits.float().square().mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow  # compiling on 2 CPU cores takes ~10 s
def test_compiled_layers_give_the_eager_numbers_in_one_graph_each():
    from torch._dynamo import reset
    from torch._dynamo.utils import counters

    mg.init_parallel_state()
    hf = tiny_hf_model(True)
    model = mg.build_gpt_model(hf.config).train()
    load_hf_weights(model, hf)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, hf.config.vocab_size, shape, generator=g) for shape in ((2, 12), (3, 17), (4, 23))]
    want = [_step(model, ids) for ids in batches]

    reset()
    counters.clear()
    mg.compile_layers(model)
    got = [_step(model, ids) for ids in batches]
    for (logits, grads), (ref_logits, ref_grads) in zip(got, want):
        assert torch.allclose(logits, ref_logits, atol=1e-5)
        for a, b in zip(grads, ref_grads):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # one graph for every layer at the first length, one dynamic one for the lengths after
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
