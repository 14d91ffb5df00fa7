"""Typed views of the config's variants: the policy-loss family as a discriminated union, LoRA and on-policy
distillation as optional parts (None: off).

The input surface stays flat: the flags (`--policy-loss sapo --sapo-tau-pos 1.2`, `--lora-rank 8`, `--use-opd`),
the YAML keys, slime's translations and docs/configuration.md's rows are one per field of the flat parts
(algorithm.py, training.py), and their defaults, bounds and error messages are those fields'. The code that acts
on a variant reads these views instead (`AlgorithmConfig.policy`, `AlgorithmConfig.opd`, `TrainingConfig.lora`),
built from the flat fields on each read (read-only: a changed field shows in the next read) and never dumped, so a
variant's settings travel together and a reader cannot pick up a field of another variant. Why not a nested
union in the config itself: the CLI makes one flag per field, the docs one row per field and slime's table maps
onto flat keys; a nested model would change all three (or need a second, flat model to keep them), for the
same behaviour.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PpoClipLoss(Part):
    """PPO's clipped ratio per token (--policy-loss ppo_clip), with the dual clip when eps_clip_c is set."""

    kind: Literal["ppo_clip"] = "ppo_clip"
    eps_clip: float = Field(description="Lower clip range of the ratio.")
    eps_clip_high: float = Field(description="Upper clip range of the ratio (eps_clip unless given).")
    eps_clip_c: float | None = Field(description="Dual clip: a negative-advantage token's loss is at most -A x c.")


class GspoLoss(Part):
    """GSPO: PPO's clip on each sequence's geometric-mean ratio (--advantage-estimator gspo with ppo_clip)."""

    kind: Literal["gspo"] = "gspo"
    eps_clip: float = Field(description="Lower clip range of the sequence ratio.")
    eps_clip_high: float = Field(description="Upper clip range of the sequence ratio (eps_clip unless given).")


class CispoLoss(Part):
    """CISPO (--policy-loss cispo): -sg[clip(ratio, 1 - eps_clip, 1 + eps_clip_high)] x A x logprob."""

    kind: Literal["cispo"] = "cispo"
    eps_clip: float = Field(description="Lower clip of the IS weight (>= 1: no lower bound).")
    eps_clip_high: float = Field(description="Upper clip of the IS weight (eps_clip unless given).")


class SapoLoss(Part):
    """SAPO (--policy-loss sapo): -A x (4/tau) x sigmoid(tau x (ratio - 1)), tau by the advantage's sign."""

    kind: Literal["sapo"] = "sapo"
    tau_pos: float = Field(gt=0.0, description="Gate temperature for positive advantages (--sapo-tau-pos).")
    tau_neg: float = Field(gt=0.0, description="Gate temperature for negative advantages (--sapo-tau-neg).")


PolicyLoss = Annotated[PpoClipLoss | GspoLoss | CispoLoss | SapoLoss, Field(discriminator="kind")]
_POLICY_LOSS: TypeAdapter[PolicyLoss] = TypeAdapter(PolicyLoss)


def policy_loss_of(algorithm) -> PpoClipLoss | GspoLoss | CispoLoss | SapoLoss:
    """The variant an AlgorithmConfig's flat fields choose. GSPO is advantage_estimator gspo (it also takes the
    group-normalised advantages) and takes precedence over policy_loss, as the loss always did; the config's
    check allows it only with ppo_clip."""
    a = algorithm
    kind = "gspo" if a.advantage_estimator == "gspo" else a.policy_loss
    high = a.eps_clip_high if a.eps_clip_high is not None else a.eps_clip
    fields = {
        "ppo_clip": {"eps_clip": a.eps_clip, "eps_clip_high": high, "eps_clip_c": a.eps_clip_c},
        "gspo": {"eps_clip": a.eps_clip, "eps_clip_high": high},
        "cispo": {"eps_clip": a.eps_clip, "eps_clip_high": high},
        "sapo": {"tau_pos": a.sapo_tau_pos, "tau_neg": a.sapo_tau_neg},
    }[kind]
    return _POLICY_LOSS.validate_python({"kind": kind, **fields})


class LoraPart(Part):
    """LoRA (--lora-rank > 0): rank-r adapters on the target projections, the base model frozen."""

    rank: int = Field(ge=1, description="Adapter rank (--lora-rank).")
    alpha: float = Field(gt=0.0, description="The adapters' output is scaled by alpha / rank (--lora-alpha).")
    dropout: float = Field(ge=0.0, lt=1.0, description="Dropout on the adapters' input (--lora-dropout).")
    target_modules: tuple[str, ...] = Field(description="Projections to adapt, peft's or Megatron-Bridge's names.")


def lora_of(training) -> LoraPart | None:
    """A TrainingConfig's LoRA part, None for full fine-tuning (lora_rank 0)."""
    t = training
    if not t.lora_rank:
        return None
    targets = tuple(t.target_modules)
    return LoraPart(rank=t.lora_rank, alpha=t.lora_alpha, dropout=t.lora_dropout, target_modules=targets)


class OpdPart(Part):
    """On-policy distillation (--use-opd): where the teacher is and the weight of its reverse KL."""

    teacher: Literal["sglang", "megatron"] = Field(
        description="sglang: a teacher engine scores each sample after its rollout; megatron: a frozen teacher "
        "model in the trainer (--opd-type)."
    )
    kl_coef: float = Field(ge=0.0, description="Weight of the reverse KL in the advantage (--opd-kl-coef).")
    teacher_load: str | None = Field(description="The teacher model, HF directory or zoo name (--opd-teacher-load).")
    teacher_url: str | None = Field(description="sglang: a running teacher engine (--opd-teacher-url).")

    @property
    def engine(self) -> bool:
        """Whether the teacher is an engine the flows drive (sglang), not a model inside the trainer."""
        return self.teacher == "sglang"


def opd_of(algorithm) -> OpdPart | None:
    """An AlgorithmConfig's OPD part, None without use_opd. A config that set use_opd without opd_type fails its
    check ("use_opd needs opd_type"); one built without the check is read as off until it names a teacher."""
    a = algorithm
    if not a.use_opd or a.opd_type is None:
        return None
    return OpdPart(teacher=a.opd_type, kl_coef=a.opd_kl_coef, teacher_load=a.opd_teacher_load,
                   teacher_url=a.opd_teacher_url)  # fmt: skip
