"""The RL objective: advantage estimator, policy loss, train/inference mismatch corrections, KL terms,
on-policy distillation and PPO's critic.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from sluiceway.flows.config.group import Group
from sluiceway.flows.config.variants import CispoLoss, GspoLoss, OpdPart, PpoClipLoss, SapoLoss, opd_of, policy_loss_of
from sluiceway.infra.plugins import check_function


class AlgorithmConfig(Group):
    advantage_estimator: Literal[
        "grpo", "dr_grpo", "gspo", "rloo", "reinforce_plus_plus_baseline", "ppo", "reinforce_plus_plus"
    ] = Field(
        "grpo",
        description="How rewards become per-token advantages. Per sample, broadcast over the response: grpo, "
        "dr_grpo, gspo, rloo (leave-one-out baseline: r_i - mean of the group's other rewards), "
        "reinforce_plus_plus_baseline. Per token, whitened over the batch's response tokens: ppo "
        "(GAE with a critic) and reinforce_plus_plus (discounted KL-shaped returns, no critic).",
    )
    normalize_advantages_by_std: bool = Field(
        True, description="GRPO: divide by the group's reward std (grpo and gspo only; rloo never divides)."
    )
    policy_loss: Literal["ppo_clip", "cispo", "sapo"] = Field(
        "ppo_clip",
        description="The policy-gradient surrogate. ppo_clip: PPO's clipped ratio (GSPO's sequence ratio with "
        "advantage_estimator gspo); cispo (MiniMax-M1): -sg[clip(ratio, 1 - eps_clip, 1 + eps_clip_high)] x A x "
        "logprob, the clipped weight carries no gradient (eps_clip >= 1: no lower bound, the paper's setting); "
        "sapo (soft adaptive policy optimization): -A x (4/tau) x sigmoid(tau x (ratio - 1)), a smooth gate "
        "instead of the clip, tau = sapo_tau_pos where A > 0, sapo_tau_neg elsewhere.",
    )
    sapo_tau_pos: float = Field(1.0, gt=0.0, description="sapo: gate temperature for positive advantages.")
    sapo_tau_neg: float = Field(
        1.05, gt=0.0, description="sapo: gate temperature for negative advantages (larger: a narrower gate)."
    )
    eps_clip: float = Field(0.2, gt=0.0, description="PPO clip range (lower); cispo: the IS weight's lower clip.")
    eps_clip_high: float | None = Field(
        None, gt=0.0, description="PPO clip range (upper); cispo: the IS weight's upper clip; default eps_clip."
    )
    eps_clip_c: float | None = Field(
        None,
        gt=1.0,
        description="Dual clip (Ye et al. 2020): bound the loss of negative-advantage tokens at -A x eps_clip_c.",
    )
    use_tis: bool = Field(
        False,
        description="Truncated importance sampling: weight each token by exp(old - rollout log-prob), "
        "clipped, to correct the training-inference mismatch.",
    )
    tis_clip: float = Field(
        2.0, gt=0.0, description="Upper clip of the TIS weight; icepop and mis: the band's upper bound."
    )
    tis_clip_low: float | None = Field(
        None,
        ge=0.0,
        description="Lower clip of the TIS weight (default none); icepop and mis: the band's lower bound "
        "(default 1 / tis_clip).",
    )
    tis_mode: Literal["truncate", "icepop", "mis"] = Field(
        "truncate",
        description="With use_tis, how the ratio exp(old - rollout log-prob) corrects the loss. truncate: TIS, "
        "the weight clamp(ratio, tis_clip_low, tis_clip); icepop (Ant Group's IcePop, slime's icepop_function): "
        "a token whose ratio lies outside [tis_clip_low, tis_clip] is masked out (weight 0), the others keep the "
        "ratio as weight; mis (sequence-level masked IS, slime's geometric level in mask mode): the same on each "
        "sequence's geometric-mean ratio, a whole sequence masked or weighted by it (give a narrow band, e.g. "
        "--tis-clip 1.01).",
    )
    custom_tis_function_path: str | None = Field(
        None,
        description="With use_tis, your correction instead of tis_mode's: 'module:fn' or 'file.py:fn', "
        "fn(old_logp, rollout_logp, mask, algorithm) -> weights [b, t] or (weights, {name: per-token tensor}), "
        "the named values logged as token means 'train/tis_NAME'. Imported when the config is read.",
    )

    @field_validator("custom_tis_function_path")
    @classmethod
    def _load_tis_function(cls, path: str | None) -> str | None:
        """The function must import and take (old_logp, rollout_logp, mask, algorithm): a mistake is one line
        when the config is read, not an exception in the trainer after the engines started."""
        if path is not None:
            check_function(path, "--custom-tis-function-path", ("old_logp", "rollout_logp", "mask", "algorithm"))
        return path

    use_kl_loss: bool = Field(False, description="Add a KL(policy || reference) loss term.")
    kl_loss_coef: float = Field(0.0, ge=0.0, description="Weight of the KL loss term.")
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = Field("low_var_kl", description="KL estimator.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Weight of the entropy bonus.")
    use_opd: bool = Field(
        False,
        description="On-policy distillation: a teacher scores the student's sampled tokens and each trained "
        "token's advantage becomes A - opd_kl_coef x (student log-prob - teacher log-prob), the per-token reverse "
        "KL (docs/distillation.md). With a zero task reward it is pure distillation. As slime's --use-opd: the same "
        "per-token term and coefficient, and the same advantages for grpo, dr_grpo, gspo and rloo; for the whitened "
        "estimators (ppo, reinforce_plus_plus, reinforce_plus_plus_baseline) the term is added after the batch "
        "whitening here and before it in slime (docs/algorithms.md).",
    )
    opd_type: Literal["sglang", "megatron"] | None = Field(
        None,
        description="use_opd: sglang: a teacher engine (opd_teacher_url, or an embedded engine the run starts on "
        "opd_teacher_load) scores each sample once after its rollout, into the trajectories' teacher_logprobs "
        "column (replay and resume read it back); megatron: a frozen megatron-core teacher from opd_teacher_load "
        "in the trainer, as the reference model.",
    )
    opd_kl_coef: float = Field(1.0, ge=0.0, description="use_opd: weight of the reverse KL in the advantage.")
    opd_teacher_load: str | None = Field(
        None,
        description="use_opd: the teacher model (HF directory or zoo name; the student's vocabulary). megatron: "
        "loaded into the trainer; sglang: served by an embedded engine the run starts on loopback.",
    )
    opd_teacher_url: str | None = Field(
        None,
        description="opd_type sglang: URL of a running teacher engine or router (SGLang, `sluiceway engine`, "
        "sglang-router) instead of opd_teacher_load.",
    )
    kl_coef: float = Field(
        0.0,
        ge=0.0,
        description="ppo / reinforce_plus_plus: reward-side KL, each response token's reward minus kl_coef x "
        "KL(policy || reference) (estimator: kl_loss_type); 0 needs no reference model.",
    )
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="ppo / reinforce_plus_plus: per-token discount.")
    lambd: float = Field(1.0, ge=0.0, le=1.0, description="ppo: GAE lambda (1: Monte-Carlo returns minus values).")
    value_clip: float | None = Field(
        0.2, gt=0.0, description="ppo: clip of the critic's value change per rollout in the value loss (null: none)."
    )
    critic_lr: float | None = Field(None, gt=0.0, description="ppo: critic learning rate (default: lr).")
    num_critic_only_steps: int = Field(
        0, ge=0, description="ppo: the first N rollout steps train the critic only (the policy waits)."
    )
    loss_agg_mode: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean",
        description="token_mean: every trained token weighs the same (DAPO); seq_mean_token_mean: "
        "every sequence weighs the same (the GRPO paper); seq_mean_token_sum_norm: token sums over the constant "
        "rollout_max_response_len (Dr. GRPO).",
    )
    loss_type: Literal["policy_loss", "sft_loss"] = Field(
        "policy_loss", description="policy_loss: the RL objective (`sluiceway run`); sft_loss: `sluiceway sft`."
    )

    def check(self, context: dict) -> None:
        if self.loss_type == "sft_loss":
            return  # SFT's loss is cross-entropy: the RL settings play no part in it
        if self.policy_loss != "ppo_clip" and (self.advantage_estimator == "gspo" or self.eps_clip_c is not None):
            raise ValueError(f"policy_loss {self.policy_loss} replaces the PPO clip: gspo and eps_clip_c need ppo_clip")
        self._check_tis()
        if self.kl_coef > 0 and not self.token_level:
            raise ValueError(
                f"kl_coef (reward-side KL) applies to ppo and reinforce_plus_plus, not {self.advantage_estimator}:"
                " use --use-kl-loss --kl-loss-coef"
            )
        if self.advantage_estimator != "ppo" and (self.critic_lr is not None or self.num_critic_only_steps):
            raise ValueError("critic_lr and num_critic_only_steps need advantage_estimator ppo (the only critic)")
        if self.use_kl_loss and self.kl_loss_coef == 0.0:
            raise ValueError("use_kl_loss is set but kl_loss_coef is 0: set --kl-loss-coef")
        self._check_opd()

    @property
    def policy(self) -> PpoClipLoss | GspoLoss | CispoLoss | SapoLoss:
        """The policy-loss variant (flows/config/variants.py) with only its own settings: what the loss reads."""
        return policy_loss_of(self)

    @property
    def opd(self) -> OpdPart | None:
        """On-policy distillation's part (flows/config/variants.py), None when off (no use_opd)."""
        return opd_of(self)

    @property
    def token_level(self) -> bool:
        """Whether the advantages are per token (whitened over the batch) rather than per sample."""
        return self.advantage_estimator in ("ppo", "reinforce_plus_plus")

    def _check_tis(self) -> None:
        """tis_mode and custom_tis_function_path choose use_tis's correction; the bounds must leave a band."""
        if not self.use_tis and (self.tis_mode != "truncate" or self.custom_tis_function_path):
            what = "custom_tis_function_path" if self.custom_tis_function_path else f"tis_mode {self.tis_mode}"
            raise ValueError(f"{what} corrects the loss only with use_tis: add --use-tis")
        if self.custom_tis_function_path and self.tis_mode != "truncate":
            raise ValueError(f"custom_tis_function_path replaces tis_mode {self.tis_mode}: give one of them")
        low = self.tis_clip_low
        if low is None and self.tis_mode != "truncate":
            low = 1.0 / self.tis_clip
        if low is not None and low > self.tis_clip:
            raise ValueError(f"the TIS lower bound {low:g} is above tis_clip {self.tis_clip:g}")

    def _check_opd(self) -> None:
        """On-policy distillation: which teacher, where. Whether a teacher must be given at all depends on the
        command (a replay reads the stored teacher log-probs): the run config checks that."""
        given = [f for f in ("opd_type", "opd_teacher_load", "opd_teacher_url") if getattr(self, f) is not None]
        if not self.use_opd:
            if given:
                what = " and ".join(given)
                raise ValueError(f"{what} set(s) up on-policy distillation: also set use_opd (--use-opd)")
            return
        if self.opd_type is None:
            raise ValueError("use_opd needs opd_type (--opd-type sglang: a teacher engine; megatron: in the trainer)")
        if self.opd_type == "megatron":
            if self.opd_teacher_url is not None:
                raise ValueError("opd_type megatron loads the teacher into the trainer: give opd_teacher_load, "
                                 "not opd_teacher_url (that is opd_type sglang)")  # fmt: skip
            if self.opd_teacher_load is None:
                raise ValueError("opd_type megatron needs opd_teacher_load (the teacher's HF directory)")
            return
        if self.opd_teacher_url is not None and self.opd_teacher_load is not None:
            raise ValueError("opd_type sglang: give opd_teacher_url (a running teacher) or opd_teacher_load (the "
                             "run starts one), not both")  # fmt: skip
        if self.opd_teacher_url is not None and not re.match(r"https?://[^/\s]+", self.opd_teacher_url):
            raise ValueError(f"opd_teacher_url: {self.opd_teacher_url!r} is not http://HOST:PORT")
