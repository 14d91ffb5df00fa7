"""The output layer fused with the vocabulary log-prob (`LinearTokenLogProbEntropy`, the trainer's path on GPUs):
the same log-probs, entropies and gradients as the output layer's logits through `TokenLogProbEntropy`, here on CPU
where both run (models/megatron_logprobs.FUSED_OUTPUT_LAYER forces it), with several chunks and a ragged last one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import sluiceway.models.fused_logprobs as fused
import sluiceway.models.megatron_gpt as mg
import sluiceway.models.megatron_logprobs as mlp
from sluiceway.models.fused_logprobs import linear_token_logprob_entropy, token_logprob_entropy
from sluiceway.models.hf_megatron import load_hf_weights

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _loss(logp, ent, w_logp, w_ent, which):
    return {"logp": (logp * w_logp).sum(), "entropy": (ent * w_ent).sum(),
            "both": (logp * w_logp + ent * w_ent).sum()}[which]  # fmt: skip


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("which", ["logp", "entropy", "both"])
def test_linear_logprobs_match_the_logits_path(monkeypatch, temperature, which):
    monkeypatch.setattr(fused, "CHUNK_ROWS", 4)  # 11 rows: chunks of 4, 4, 3
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(11, 16, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = (0.5 * torch.randn(97, 16, generator=g)).requires_grad_()
    targets = torch.randint(0, 97, (11,), generator=g)
    w_logp, w_ent = torch.randn(11, generator=g), torch.randn(11, generator=g)

    logp, ent = linear_token_logprob_entropy(hidden, weight, targets, temperature)
    ref_logp, ref_ent = token_logprob_entropy(F.linear(hidden, weight), targets, temperature)
    assert logp.dtype == ent.dtype == torch.float32
    assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    got = torch.autograd.grad(_loss(logp, ent, w_logp, w_ent, which), (hidden, weight))
    want = torch.autograd.grad(_loss(ref_logp, ref_ent, w_logp, w_ent, which), (hidden, weight))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_linear_logprobs_in_bf16_keep_the_model_dtype_for_gradients():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(40, 32, generator=g).bfloat16().requires_grad_()
    weight = (0.3 * torch.randn(200, 32, generator=g)).bfloat16().requires_grad_()
    targets = torch.randint(0, 200, (40,), generator=g)
    logp, ent = linear_token_logprob_entropy(hidden, weight, targets)
    ref_logp, ref_ent = token_logprob_entropy(F.linear(hidden, weight), targets)
    # The same bf16 products (a chunk's rows are rows of the one product): the same logits, the same numbers.
    assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    logp.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    h2, w2 = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    token_logprob_entropy(F.linear(h2, w2), targets)[0].sum().backward()
    assert torch.allclose(hidden.grad.float(), h2.grad.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(weight.grad.float(), w2.grad.float(), atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def _parallel_state():
    mg.init_parallel_state()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_megatron_model_fused_output_layer_gives_the_same_logprobs_and_gradients(_parallel_state, monkeypatch,
                                                                                 tied, packed):  # fmt: skip
    monkeypatch.setattr(fused, "CHUNK_ROWS", 8)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=300, max_position_embeddings=128,
                         tie_word_embeddings=tied)  # fmt: skip
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (3, 24), generator=g)
    needed = torch.zeros(3, 23, dtype=torch.bool)
    needed[:, 9:] = True
    needed[1, 20:] = False  # a shorter sample
    mask = mlp.packed_attention_mask(torch.arange(24).div(9, rounding_mode="floor").expand(3, 24)) if packed else None

    def run(fused_layer: bool):
        monkeypatch.setattr(mlp, "FUSED_OUTPUT_LAYER", fused_layer)
        model = mg.build_gpt_model(config).train()
        load_hf_weights(model, hf)
        assert (mlp.fused_output_weight(model, ids.device) is not None) == fused_layer
        logp, ent = mlp.token_logprobs_and_entropy(model, ids, 0.8, attention_mask=mask, needed=needed)
        (logp.sum() + 0.1 * ent.sum()).backward()
        return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    logp, ent, grads = run(True)
    ref_logp, ref_ent, ref_grads = run(False)
    assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    assert set(grads) == set(ref_grads)
    for n, gr in ref_grads.items():
        assert torch.allclose(grads[n], gr, atol=1e-5, rtol=1e-4), n


@pytest.mark.slow  # compiling on 2 CPU cores takes ~40 s
def test_chunk_kernels_compile_to_the_eager_numbers():
    """What CUDA runs (`_chunk_stats` / `_chunk_grad` under torch.compile) is checked against the eager functions
    where it can be compiled here (inductor's CPU backend); the GPU run is tests/gpu's."""
    kernels = fused._compiled_chunk_kernels.__wrapped__("cpu")
    if kernels is None:
        pytest.skip("torch.compile does not work on this machine")
    g = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(37, 101, generator=g)
    targets = torch.randint(0, 101, (37,), generator=g)
    for t in (1.0, 0.6):
        got, want = kernels[0](logits, targets, t), fused._chunk_stats(logits, targets, t)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-5)
        g_lp, g_h = torch.randn(37, generator=g), torch.randn(37, generator=g)
        args = (logits, targets, want[2], want[1], g_lp, g_h, t)
        assert torch.allclose(kernels[1](*args, torch.float32), fused._chunk_grad(*args, torch.float32), atol=1e-5)
