"""LoRA on the megatron GPTModel against peft's LoraModel on the same HF weights and adapter (fp32, TP=1).

TP=2 is tests/integration/test_lora_tp2.py. Both models get the same random A and B (peft's init_lora_weights=False),
so a wrongly placed q/k/v or gate/up piece, a transposed factor or a wrong scale shows in the log-probs."""

from __future__ import annotations

import pytest
import torch
from lora_helpers import (
    TARGETS,
    batch,
    hf_model,
    megatron_logprobs,
    megatron_with_adapter,
    peft_adapter,
    peft_logprobs,
    peft_model,
)

from sluiceway.models.lora import (
    LoraAdapters,
    LoraSpec,
    merge_into_hf,
    merge_tp_adapters,
    read_adapter_dir,
    resolve_targets,
    write_adapter_dir,
)
from sluiceway.models.megatron_gpt import init_parallel_state

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
KINDS = ["llama-tied", "llama-untied", "qwen2"]


@pytest.fixture(scope="module", autouse=True)
def _parallel_state():
    init_parallel_state()


@pytest.mark.parametrize("targets", [TARGETS, ("q_proj", "v_proj"), ("k_proj", "up_proj", "o_proj")],
                         ids=["all", "q-v", "k-up-o"])  # fmt: skip
@pytest.mark.parametrize("kind", KINDS)
def test_forward_and_gradients_match_peft(kind, targets):
    ids, mask = batch()
    pm = peft_model(kind, targets)
    adapter = peft_adapter(pm)
    ref = peft_logprobs(pm, ids)
    (ref * mask).sum().backward()
    peft_grads = {n: p.grad for n, p in pm.named_parameters() if p.requires_grad}

    gpt, lora = megatron_with_adapter(hf_model(kind), adapter, targets)
    logp = megatron_logprobs(gpt, ids)
    torch.testing.assert_close(logp * mask, ref.detach() * mask, atol=1e-5, rtol=0)
    (logp * mask).sum().backward()
    ours = {k: g for k, g in _grads(lora).items()}
    assert set(ours) == {k.replace(".default", "") for k in peft_grads}
    for name, g in peft_grads.items():
        torch.testing.assert_close(ours[name.replace(".default", "")], g, atol=1e-5, rtol=1e-4, msg=name)
    assert not any(p.grad is not None for p in gpt.parameters()), "the base model must stay frozen"


def _grads(lora: LoraAdapters) -> dict[str, torch.Tensor]:
    from sluiceway.models.lora import peft_key

    return {peft_key(i, t, w): p[f"{t}_{w}"].grad for i, p in enumerate(lora.layers)
            for t in lora.spec.targets for w in ("A", "B")}  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_merged_weights_equal_peft_merge(kind):
    pm = peft_model(kind)
    adapter = peft_adapter(pm)
    spec = LoraSpec(4, 8.0, 0.0, TARGETS)
    base = hf_model(kind).state_dict()
    ours = merge_into_hf(base, adapter, spec)
    theirs = pm.merge_and_unload().state_dict()
    for k, v in theirs.items():
        torch.testing.assert_close(ours[k], v, atol=1e-6, rtol=0, msg=k)


def test_disabled_is_the_base_model():
    ids, _ = batch()
    pm = peft_model("llama-untied")
    gpt, lora = megatron_with_adapter(hf_model("llama-untied"), peft_adapter(pm))
    with lora.disabled():
        base = megatron_logprobs(gpt, ids)
    with pm.disable_adapter():
        ref = peft_logprobs(pm, ids)
    torch.testing.assert_close(base, ref, atol=1e-5, rtol=0)
    assert not torch.allclose(megatron_logprobs(gpt, ids), base, atol=1e-3)


def test_fresh_adapter_is_the_base_model_and_layout_independent():
    """peft's initial values: B = 0, so the adapted model starts as the base; A is drawn whole and sliced."""
    hf = hf_model("llama-untied")
    spec = LoraSpec(4, 8.0, 0.0, TARGETS)
    a, b = LoraAdapters(hf.config, spec, seed=3), LoraAdapters(hf.config, spec, seed=3)
    sa, sb = a.local_state(), b.local_state()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(v.abs().sum() == 0 for k, v in sa.items() if "lora_B" in k)
    bound = 1 / 64**0.5  # kaiming_uniform(a=sqrt(5)) on A [r, in=64]: U(-1/sqrt(in), 1/sqrt(in))
    q_a = sa["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert q_a.abs().max() <= bound and q_a.std() > bound / 3
    assert merge_tp_adapters([sa]).keys() == sa.keys()


def test_adapter_dir_round_trips_through_peft(tmp_path):
    """Our adapter directory is one peft loads (PeftModel.from_pretrained) and gives the same outputs."""
    from peft import PeftModel

    pm = peft_model("qwen2")
    adapter = peft_adapter(pm)
    spec = LoraSpec(4, 8.0, 0.0, TARGETS)
    write_adapter_dir(adapter, spec, tmp_path / "a", base_model="tiny-qwen2")
    loaded = PeftModel.from_pretrained(hf_model("qwen2"), tmp_path / "a").eval()
    ids, _ = batch()
    torch.testing.assert_close(peft_logprobs(loaded, ids), peft_logprobs(pm, ids), atol=1e-6, rtol=0)
    spec2, back = read_adapter_dir(tmp_path / "a")
    assert spec2 == spec and all(torch.equal(back[k], adapter[k]) for k in adapter)
    # And a directory peft wrote reads back as the same adapter.
    pm.save_pretrained(tmp_path / "p")
    spec3, theirs = read_adapter_dir(tmp_path / "p")
    assert spec3 == spec and all(torch.equal(theirs[k], adapter[k]) for k in adapter)


def test_target_names():
    assert resolve_targets(["all-linear"]) == list(TARGETS)
    assert resolve_targets(["linear_qkv", "down_proj"]) == ["q_proj", "k_proj", "v_proj", "down_proj"]
    assert resolve_targets(["v_proj", "q_proj", "q_proj"]) == ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match="unknown LoRA target module 'lm_head'"):
        resolve_targets(["lm_head"])


@pytest.mark.parametrize("kind", KINDS)
def test_memory_plan_counts_the_adapters(kind):
    """The adapter count the memory plan asks for (`sluiceway plan` and the preflight), from the config.json dict
    without building anything, is what the trainer's LoraAdapters holds."""
    from sluiceway.models.lora import adapter_parameters

    hf = hf_model(kind)
    targets = ("q_proj", "v_proj", "down_proj")
    lora = LoraAdapters(hf.config, LoraSpec(4, 8.0, 0.0, targets), seed=0)
    assert adapter_parameters(hf.config.to_dict(), 4, targets) == sum(p.numel() for p in lora.parameters())


def test_config_knows_the_same_target_names():
    from sluiceway.flows.config import LORA_TARGET_NAMES
    from sluiceway.models.lora import MEGATRON_NAMES, TARGETS

    assert set(LORA_TARGET_NAMES) == {"all-linear", *TARGETS, *MEGATRON_NAMES}


def test_sglang_engines_start_with_lora_serving_flags():
    from types import SimpleNamespace as NS

    from sluiceway.models.lora import lora_server_args

    def cfg(rank, sync="adapter", targets=("linear_qkv", "down_proj")):
        return NS(training=NS(lora_rank=rank, target_modules=list(targets)), sync=NS(lora_sync=sync))

    assert lora_server_args(cfg(16)) == [
        "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "k_proj", "v_proj", "down_proj",
    ]  # fmt: skip
    assert lora_server_args(cfg(16, "merged")) == [] and lora_server_args(cfg(0)) == []
