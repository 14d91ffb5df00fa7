"""Activation recompute (Megatron's --recompute-granularity full|selective, --recompute-method, --recompute-num-layers)
on CPU: the same gradients as without it, bit for bit, with less kept for backward.

megatron's checkpoint function saves and restores the CUDA generator's state, which fails without CUDA;
models/megatron_gpt.py swaps in CPU-only RNG helpers. Attention dropout is on here, so a replay that drew other
dropout masks than the forward did would give other gradients. fp32, a 4-layer Llama and a 2-layer Qwen3 (q/k
norms), packed rows with an attention mask too; the peak memory of a real training step is measured by
benchmarks/bench_recompute.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sluiceway.models.hf_megatron import load_hf_weights
from sluiceway.models.megatron_gpt import build_gpt_model, init_parallel_state, recompute_overrides
from sluiceway.models.megatron_logprobs import packed_attention_mask, token_logprobs_and_entropy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

VOCAB = 300
SETTINGS = {
    "full": ("full", None, None),
    "full-uniform-2": ("full", "uniform", 2),
    "full-block-1": ("full", "block", 1),
    "full-block-3": ("full", "block", 3),
    "selective": ("selective", None, None),
}


def rc(granularity=None, method=None, num_layers=None):
    return SimpleNamespace(recompute_granularity=granularity, recompute_method=method, recompute_num_layers=num_layers)


@pytest.fixture(scope="module", autouse=True)
def _parallel_state():
    init_parallel_state()


@pytest.fixture(scope="module")
def llama():
    config = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=128,
                         tie_word_embeddings=False, attention_dropout=0.1)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def qwen3():
    from qwen3_helpers import qwen3_model

    model = qwen3_model()
    model.config.attention_dropout = 0.1
    return model


def batch(packed: bool):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 24), generator=g)
    needed = torch.zeros(3, 23, dtype=torch.bool)
    needed[:, 10:] = True
    mask = packed_attention_mask(torch.arange(24).div(9, rounding_mode="floor").expand(3, 24)) if packed else None
    return ids, needed, mask


def step(hf, settings, packed=False, seed=5):
    """Gradients of a policy-style loss (log-probs and entropy at the trained positions), and the bytes the forward
    kept for backward (unique storages, parameters excluded)."""
    model = build_gpt_model(hf.config, **recompute_overrides(settings)).train()
    load_hf_weights(model, hf)
    ids, needed, mask = batch(packed)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(seed)  # the dropout masks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, entropy = token_logprobs_and_entropy(model, ids, 0.7, attention_mask=mask, needed=needed)
    (logp.sum() + 0.1 * entropy.sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return grads, sum(n for ptr, n in kept.items() if ptr not in params), model


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_recompute_gives_the_same_gradients_with_less_kept(llama, name, packed):
    base, base_kept, _ = step(llama, rc(), packed)
    grads, kept, model = step(llama, rc(*SETTINGS[name]), packed)
    assert model.config.recompute_granularity == SETTINGS[name][0]
    assert set(grads) == set(base)
    for n, g in base.items():
        assert torch.equal(grads[n], g), n  # the same kernels on the same inputs: bit for bit
    assert kept < base_kept


def test_dropout_is_on_so_the_replay_is_tested(llama):
    a, _, _ = step(llama, rc(), seed=5)
    b, _, _ = step(llama, rc(), seed=6)
    assert any(not torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("name", ["full", "selective"])
def test_qwen3_recompute_gives_the_same_gradients(qwen3, name):
    base, base_kept, _ = step(qwen3, rc(), packed=True)
    grads, kept, _ = step(qwen3, rc(*SETTINGS[name]), packed=True)
    assert all(torch.equal(grads[n], g) for n, g in base.items())
    assert kept < base_kept


def test_full_recompute_keeps_only_layer_inputs(llama):
    """Full recompute of every layer keeps far less than selective, which keeps less than none."""
    _, none, _ = step(llama, rc())
    _, selective, _ = step(llama, rc("selective"))
    _, full, _ = step(llama, rc("full"))
    assert full < selective < none
    assert full < none / 3


def test_recompute_overrides_follow_megatrons_rules():
    assert recompute_overrides(rc()) == {}
    assert recompute_overrides(rc("selective")) == {"recompute_granularity": "selective"}
    full = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    assert recompute_overrides(rc("full")) == full
    assert recompute_overrides(rc("full", "block", 3))["recompute_method"] == "block"
    with pytest.raises(ValueError, match="need recompute_granularity full"):
        recompute_overrides(rc(None, "uniform", 2))
    with pytest.raises(ValueError, match="selective takes no"):
        recompute_overrides(rc("selective", None, 2))


def test_eval_mode_and_no_grad_skip_recompute(llama):
    """Log-probs for the old policy and the reference model (no_grad, eval) are the same with recompute set."""
    ids, _, _ = batch(False)
    out = []
    for settings in (rc(), rc("full")):
        model = build_gpt_model(llama.config, **recompute_overrides(settings)).eval()
        load_hf_weights(model, llama)
        with torch.no_grad():
            out.append(token_logprobs_and_entropy(model, ids, 0.7)[0])
    assert torch.equal(out[0], out[1])
