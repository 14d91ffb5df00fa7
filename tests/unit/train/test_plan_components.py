"""The memory plan's trainer numbers are the trainer components' own answers (issue 33 point 4): LoRA's adapter
count is models/lora.py's, which is what a built LoraAdapters holds; the optimizer state is tasks/train/optim.py's,
which is what a trainer's optimizer holds after a step; the model transform says what trains and whether it has
fp32 masters."""

from __future__ import annotations

import json

import pytest
from trainer_group_helpers import batch

from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
from sluiceway.models.lora import TARGETS, LoraAdapters, LoraSpec, adapter_parameters
from sluiceway.models.megatron_gpt import init_parallel_state
from sluiceway.tasks.train.memory_model import Layout, ModelShape
from sluiceway.tasks.train.memory_plan import plan
from sluiceway.tasks.train.model_transform import planned_training
from sluiceway.tasks.train.optim import state_bytes_per_rank
from sluiceway.tasks.train.trainer import PolicyTrainer


def by_label(p) -> dict[str, int]:
    return {i.label: i.bytes for i in p.static + p.backward + p.step}


def hf_dict(path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("targets", [tuple(TARGETS), ("q_proj", "v_proj", "down_proj")], ids=["all", "q-v-down"])
def test_plan_counts_the_adapters_models_lora_builds(tiny, targets):
    from transformers import AutoConfig

    path, _ = tiny
    init_parallel_state()
    built = LoraAdapters(AutoConfig.from_pretrained(path), LoraSpec(8, 16.0, 0.0, targets), seed=0)
    n = sum(p.numel() for p in built.parameters())
    hf = hf_dict(path)
    assert adapter_parameters(hf, 8, targets) == n
    got = by_label(plan(hf, Layout(bf16=True, lora_rank=8, lora_targets=targets)))
    assert got["LoRA adapters (fp32)"] == 4 * n
    assert got["gradients (LoRA adapters, fp32)"] == 4 * n
    assert got["Adam moments (fp32 m, v)"] == state_bytes_per_rank(n, separate_masters=False)[1] == 8 * n
    assert "fp32 master weights" not in got  # the fp32 adapters are their own masters


def test_the_transform_says_what_trains():
    full = planned_training({}, 0, (), 1000, bf16=True, tp_size=1)
    assert (full.parameters, full.width, full.separate_masters, full.reference_bytes) == (1000, 2, True, 2000)
    hf = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "num_hidden_layers": 2}
    lora = planned_training(hf, 4, ("q_proj", "down_proj"), 1000, bf16=True, tp_size=2)
    # q_proj column-parallel: r x (64 + 64/2); down_proj row-parallel: r x (128/2 + 64); two layers
    assert (lora.parameters, lora.separate_masters, lora.reference_bytes) == (2 * 4 * (96 + 128), False, 0)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_plan_counts_the_optimizer_state_a_trainer_holds(tiny, bf16):
    path, tok = tiny
    training = TrainingConfig(global_batch_size=8, micro_batch_size=2, bf16=bf16, hf_checkpoint=str(path))
    trainer = PolicyTrainer(path, training, AlgorithmConfig(), temperature=0.8, pad_token_id=tok.pad_token_id)
    trainer.train_rollout(batch(tok), 0)
    hf = hf_dict(path)
    assert ModelShape.from_hf(hf).parameters() == sum(p.numel() for p in trainer.model.parameters())
    got = by_label(plan(hf, Layout(bf16=bf16)))
    held = got.get("fp32 master weights", 0) + got["Adam moments (fp32 m, v)"]
    assert ("fp32 master weights" in got) == bf16
    assert trainer.optimizer_state_bytes() == pytest.approx(held, rel=1e-3)  # + AdamW's step counts
