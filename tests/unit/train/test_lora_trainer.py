"""The policy trainer with --lora-rank on tiny-llama: only the adapters train (the base stays bit-identical), the
reference of a KL loss is the base model, an adapter checkpoint holds the adapters and optimizer only and resumes
bit-identically, and the published versions (adapter or merged) load into engines and transformers."""

from __future__ import annotations

import pytest
import torch
from test_trainer import samples
from trainer_helpers import sequence_logprob

from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
from sluiceway.models.hf_megatron import megatron_state_dict
from sluiceway.models.lora import is_adapter_dir, merge_into_hf, read_adapter_dir
from sluiceway.models.zoo import load_hf_state_dict
from sluiceway.tasks.train.trainer import PolicyTrainer


def lora_trainer(path, tok, bf16=False, **algo):
    training = TrainingConfig(
        global_batch_size=4, micro_batch_size=2, lr=1e-2, bf16=bf16, hf_checkpoint=str(path), lora_rank=4,
        lora_alpha=8, lr_warmup_iters=1, lr_decay_style="cosine", min_lr=1e-3,
    )  # fmt: skip
    return PolicyTrainer(path, training, AlgorithmConfig(**algo), temperature=1.0, pad_token_id=tok.pad_token_id)


BATCHES = ([1.0, -1.0, 1.0, -1.0], [-1.0, 1.0, 0.5, -0.5], [0.2, -0.2, 1.0, -1.0], [1.0, 1.0, -1.0, -1.0])


@pytest.mark.parametrize("bf16", [False, True])
def test_only_the_adapters_train(tiny, bf16):
    path, tok = tiny
    t = lora_trainer(path, tok, bf16=bf16)
    base = {k: v.clone() for k, v in megatron_state_dict(t.model).items()}
    batch = samples(tok, [1.0, -1.0, 1.0, -1.0])
    before = [sequence_logprob(t, s) for s in batch]
    t.train_rollout(batch, step=0)
    t.train_rollout(batch, step=1)  # the first step moves A only (B starts at zero): the second moves the output
    after = [sequence_logprob(t, s) for s in batch]
    assert after[0] > before[0] and after[1] < before[1]
    assert all(torch.equal(v, megatron_state_dict(t.model)[k]) for k, v in base.items())  # base untouched
    n_adapter = sum(p.numel() for p in t.trainable.parameters())
    assert n_adapter < 0.1 * sum(p.numel() for p in t.model.parameters())
    assert sum(p.numel() for g in t.optimizer.param_groups for p in g["params"]) == n_adapter
    assert all(p.dtype == torch.float32 for p in t.trainable.parameters())  # fp32 adapters, also over bf16


def test_kl_reference_is_the_base_model_without_a_second_copy(tiny):
    path, tok = tiny
    t = lora_trainer(path, tok, use_kl_loss=True, kl_loss_coef=0.1)
    assert t.ref_model is None
    m0 = t.train_rollout(samples(tok, BATCHES[0]), step=0)
    t.train_rollout(samples(tok, BATCHES[0]), step=1)
    m2 = t.train_rollout(samples(tok, BATCHES[0]), step=2)
    assert m0["kl"] == pytest.approx(0.0, abs=1e-7)  # B = 0: the adapted model is the base
    assert m2["kl"] > 0


def test_adapter_checkpoint_resumes_bit_identically(tiny, tmp_path):
    path, tok = tiny
    straight = lora_trainer(path, tok)
    for step, adv in enumerate(BATCHES):
        straight.train_rollout(samples(tok, adv), step)

    first = lora_trainer(path, tok)
    for step, adv in enumerate(BATCHES[:2]):
        first.train_rollout(samples(tok, adv), step)
    first.save(tmp_path / "ckpt", step=1)
    del first
    saved = torch.load(tmp_path / "ckpt" / "tp0.pt", weights_only=False)
    assert all(".lora_" not in k and ("_A" in k or "_B" in k) for k in saved["model"])  # adapters only
    assert sum(v.numel() for v in saved["model"].values()) == sum(p.numel() for p in straight.trainable.parameters())

    resumed = lora_trainer(path, tok)
    start = resumed.load(tmp_path / "ckpt") + 1
    for step, adv in enumerate(BATCHES[start:], start=start):
        resumed.train_rollout(samples(tok, adv), step)
    assert resumed.weight_version == straight.weight_version == 4
    a, b = straight.adapter_state_dict(), resumed.adapter_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)


def test_published_adapter_and_merged_versions(tiny, tmp_path):
    path, tok = tiny
    t = lora_trainer(path, tok)
    for step, adv in enumerate(BATCHES[:2]):
        t.train_rollout(samples(tok, adv), step)
    adapter_dir = t.write_weights(path, tmp_path / "a", adapter_only=True)
    merged_dir = t.write_weights(path, tmp_path / "m")
    assert is_adapter_dir(adapter_dir) and not is_adapter_dir(merged_dir)
    spec, adapter = read_adapter_dir(adapter_dir)
    merged = load_hf_state_dict(merged_dir)
    rebuilt = merge_into_hf(load_hf_state_dict(path), adapter, spec)
    assert set(merged) <= set(rebuilt)
    assert all(torch.equal(merged[k], rebuilt[k]) for k in merged)
    size = sum(f.stat().st_size for f in adapter_dir.iterdir())
    assert size < 0.2 * sum(f.stat().st_size for f in merged_dir.glob("*.safetensors"))
