"""The embedded engine serving a LoRA adapter version (--lora-sync adapter): it merges the adapter into the base
weights it started from, so it samples the same tokens with the same log-probs (1e-5) as an engine serving the
merged model, and a second adapter replaces the first rather than adding to it."""

from __future__ import annotations

import shutil

import pytest
import torch

from sluiceway.models.engine import Engine, GenerateRequest, SamplingParams
from sluiceway.models.lora import LoraAdapters, LoraSpec, merge_into_hf, write_adapter_dir
from sluiceway.models.megatron_gpt import init_parallel_state
from sluiceway.models.zoo import load_hf_state_dict, resolve_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
SPEC = LoraSpec(8, 16.0, 0.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return resolve_checkpoint("tiny-llama", cache_dir=tmp_path_factory.mktemp("cache"))


def random_adapter(model_dir, seed: int) -> dict[str, torch.Tensor]:
    """An adapter with a non-zero B (a trained one), drawn whole."""
    from transformers import AutoConfig

    init_parallel_state()
    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    adapter = LoraAdapters(cfg, SPEC, seed=seed).local_state()
    g = torch.Generator().manual_seed(seed)
    return {k: (0.05 * torch.randn(v.shape, generator=g) if "lora_B" in k else v) for k, v in adapter.items()}


def merged_dir(model_dir, adapter, out):
    from safetensors.torch import save_file

    shutil.copytree(model_dir, out)
    sd = merge_into_hf(load_hf_state_dict(model_dir), adapter, SPEC)
    save_file({k: v.contiguous() for k, v in sd.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out


def sample(engine: Engine):
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=16, sampling_seed=s, ignore_eos=True))
            for p, s in (([5, 6, 7], 1), ([9, 8, 30, 31], 2))]  # fmt: skip
    return engine.generate(reqs)


def test_adapter_version_serves_as_the_merged_model(model_dir, tmp_path):
    first, second = random_adapter(model_dir, 1), random_adapter(model_dir, 2)
    write_adapter_dir(first, SPEC, tmp_path / "v1", base_model=str(model_dir))
    write_adapter_dir(second, SPEC, tmp_path / "v2", base_model=str(model_dir))
    served = Engine(model_dir, max_running_requests=2, max_total_len=128)
    merged = Engine(merged_dir(model_dir, second, tmp_path / "merged"), max_running_requests=2, max_total_len=128)
    try:
        base_out = sample(served)
        served.update_weights_from_disk(tmp_path / "v1", "1")
        after_first = sample(served)
        served.update_weights_from_disk(tmp_path / "v2", "2")  # replaces v1's adapter, from the base weights
        ours, theirs = sample(served), sample(merged)
        assert served.weight_version == "2"
        for a, b in zip(ours, theirs):
            assert a.output_ids == b.output_ids
            assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
        assert any(a.output_logprobs != pytest.approx(b.output_logprobs, abs=1e-3) for a, b in zip(ours, base_out))
        assert any(a.output_logprobs != pytest.approx(b.output_logprobs, abs=1e-3) for a, b in zip(ours, after_first))
    finally:
        served.shutdown()
        merged.shutdown()


def test_an_adapter_that_does_not_fit_leaves_the_weights_serving(model_dir, tmp_path):
    from sluiceway.models.engine.calls import EngineError

    adapter = random_adapter(model_dir, 1)
    adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] = torch.zeros(3, 8)
    write_adapter_dir(adapter, SPEC, tmp_path / "bad", base_model=str(model_dir))
    engine = Engine(model_dir, max_running_requests=2, max_total_len=128)
    try:
        before = sample(engine)
        with pytest.raises(EngineError, match="update_weights_from_disk"):
            engine.update_weights_from_disk(tmp_path / "bad", "1")
        assert [o.output_ids for o in sample(engine)] == [o.output_ids for o in before]
    finally:
        engine.shutdown()


def test_bf16_engine_serves_the_trainers_merged_bits(model_dir, tmp_path):
    """A bf16 engine merges into its base rounded to bf16 first, as the trainer holds it: the weights it serves are
    bit for bit the trainer's merged version (--lora-sync merged), not an fp32 merge rounded once."""
    from safetensors.torch import save_file

    adapter = random_adapter(model_dir, 1)
    write_adapter_dir(adapter, SPEC, tmp_path / "v1", base_model=str(model_dir))
    base_bf16 = {k: v.to(torch.bfloat16) for k, v in load_hf_state_dict(model_dir).items()}
    merged = merge_into_hf(base_bf16, adapter, SPEC)  # what the trainer writes under --bf16
    out = tmp_path / "merged"
    shutil.copytree(model_dir, out)
    save_file({k: v.contiguous() for k, v in merged.items()}, out / "model.safetensors", metadata={"format": "pt"})
    a = Engine(model_dir, max_running_requests=2, max_total_len=128, dtype=torch.bfloat16)
    b = Engine(out, max_running_requests=2, max_total_len=128, dtype=torch.bfloat16)
    try:
        a.update_weights_from_disk(tmp_path / "v1", "1")
        assert a.runner.w.keys() == b.runner.w.keys()  # norms, embeddings (matrices may be packed: compare outputs)
        assert all(torch.equal(a.runner.w[k], b.runner.w[k]) for k in a.runner.w)
        for x, y in zip(sample(a), sample(b)):
            assert x.output_ids == y.output_ids and x.output_logprobs == y.output_logprobs
    finally:
        a.shutdown()
        b.shutdown()
