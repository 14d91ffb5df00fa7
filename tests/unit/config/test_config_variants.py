"""The typed views of the config's variants (flows/config/variants.py): each policy loss with only its own
settings, LoRA and OPD as parts that are None when off, all read from the same flat flags and YAML keys."""

import pytest
from pydantic import TypeAdapter, ValidationError

from sluiceway.flows.cli import make_parser, resolve_config
from sluiceway.flows.config import (
    AlgorithmConfig,
    CispoLoss,
    GspoLoss,
    LoraPart,
    OpdPart,
    PolicyLoss,
    PpoClipLoss,
    SapoLoss,
    TrainingConfig,
)


def test_each_policy_loss_has_its_own_fields():
    assert AlgorithmConfig().policy == PpoClipLoss(eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None)
    dual = AlgorithmConfig(eps_clip=0.1, eps_clip_high=0.28, eps_clip_c=3.0).policy
    assert dual == PpoClipLoss(eps_clip=0.1, eps_clip_high=0.28, eps_clip_c=3.0)
    assert AlgorithmConfig(advantage_estimator="gspo", eps_clip=3e-4).policy == GspoLoss(
        eps_clip=3e-4, eps_clip_high=3e-4
    )
    cispo = AlgorithmConfig(policy_loss="cispo", eps_clip=1.0, eps_clip_high=4.0).policy
    assert cispo == CispoLoss(eps_clip=1.0, eps_clip_high=4.0)
    sapo = AlgorithmConfig(policy_loss="sapo", sapo_tau_pos=1.2).policy
    assert sapo == SapoLoss(tau_pos=1.2, tau_neg=1.05)
    # A variant carries no other variant's settings.
    assert not hasattr(sapo, "eps_clip") and not hasattr(cispo, "tau_pos") and not hasattr(cispo, "eps_clip_c")
    assert {type(v).model_fields["kind"].default for v in (dual, cispo, sapo)} == {"ppo_clip", "cispo", "sapo"}


def test_the_union_is_discriminated_by_kind():
    adapter = TypeAdapter(PolicyLoss)
    assert adapter.validate_python({"kind": "sapo", "tau_pos": 1.0, "tau_neg": 2.0}) == SapoLoss(
        tau_pos=1.0, tau_neg=2.0
    )
    with pytest.raises(ValidationError):
        adapter.validate_python({"kind": "sapo", "eps_clip": 0.2, "tau_pos": 1.0, "tau_neg": 1.0})
    with pytest.raises(ValidationError):
        adapter.validate_python({"kind": "dapo"})


def test_the_view_follows_the_flat_fields():
    a = AlgorithmConfig()
    a.policy_loss = "sapo"
    assert isinstance(a.policy, SapoLoss)
    # The views are never dumped: the YAML a config writes keeps the flat keys only.
    assert not {"policy", "opd"} & set(a.model_dump()) and "lora" not in TrainingConfig().model_dump()


def test_lora_absent_is_off():
    assert TrainingConfig().lora is None and TrainingConfig(lora_rank=0, lora_alpha=8.0).lora is None
    lora = TrainingConfig(lora_rank=8, lora_alpha=16.0, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]).lora
    assert lora == LoraPart(rank=8, alpha=16.0, dropout=0.1, target_modules=("q_proj", "v_proj"))


def test_opd_absent_is_off():
    assert AlgorithmConfig().opd is None
    megatron = AlgorithmConfig(use_opd=True, opd_type="megatron", opd_teacher_load="tiny-llama", opd_kl_coef=0.5)
    assert megatron.opd == OpdPart(teacher="megatron", kl_coef=0.5, teacher_load="tiny-llama", teacher_url=None)
    assert not megatron.opd.engine
    url = "http://127.0.0.1:30000"
    sglang = AlgorithmConfig(use_opd=True, opd_type="sglang", opd_teacher_url=url).opd
    assert sglang.engine and sglang.teacher_url == url and sglang.teacher_load is None


def test_the_flags_reach_the_views():
    argv = ["run", "--prompt-data", "env:arithmetic", "--policy-loss", "sapo", "--sapo-tau-pos", "1.2"]
    cfg = resolve_config(make_parser().parse_args([*argv, "--lora-rank", "4"]))
    assert cfg.algorithm.policy == SapoLoss(tau_pos=1.2, tau_neg=1.05)
    assert cfg.training.lora.rank == 4 and cfg.algorithm.opd is None
