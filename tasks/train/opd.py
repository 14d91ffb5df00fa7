"""On-policy distillation (OPD): the teacher's log-probs of the student's own sampled tokens, as an advantage term.

The student samples a response; a teacher (a frozen model with the student's vocabulary) scores the same token ids;
each trained token's advantage is shifted by the per-token reverse KL (Agarwal et al. 2024, "On-Policy
Distillation of Language Models"; Thinking Machines' "On-Policy Distillation", 2025):

    kl_t = log pi_student(y_t | x, y_<t) - log pi_teacher(y_t | x, y_<t)        (on the sampled token y_t)
    A'_t = A_t - opd_kl_coef * kl_t                                             (trained tokens; 0 elsewhere)

kl_t is a one-sample estimate of KL(pi_student || pi_teacher) at position t: its expectation over y_t ~ pi_student
is the reverse KL. It is a constant of the loss (no gradient through either log-prob): the policy-gradient loss
then raises the student's probability of tokens the teacher likes more than the student does (kl_t < 0) and lowers
the rest, which minimises the sequence-level reverse KL. A_t is the configured estimator's advantage (GRPO, RLOO,
PPO's GAE, ...), so OPD adds to any of them; with a task reward that is always 0 the group estimators' A_t are 0 and
the objective is pure distillation (PPO's GAE advantages are not: its critic's values make them non-zero).

Against slime's --use-opd (apply_opd_kl_to_advantages): the same per-token term and the same coefficient
(opd_kl_coef), so the same advantages for the estimators that are not whitened (grpo, dr_grpo, gspo, rloo). For
the whitened ones (ppo, reinforce_plus_plus, reinforce_plus_plus_baseline) the term is added here after the batch
whitening (the trainer calls `micro_batch_opd` per micro-batch, once the advantages are final), and in slime before
it, so there it is centred and rescaled with the advantages; here it keeps its absolute scale. docs/algorithms.md.

The student's log-probs are the trainer's, before the step's update (the PPO old policy: at the rollout
temperature, the distribution the student samples from); the teacher's are its unscaled distribution (temperature
1, what SGLang's input_token_logprobs report), the target the sampled distribution is pulled to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sluiceway.flows.config import OpdPart

if TYPE_CHECKING:  # torch is imported where the term runs: the memory plan asks `trainer_bytes` before any torch
    import torch


def opd_advantages(
    advantages: torch.Tensor,
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A - kl_coef * (student_logp - teacher_logp) on the trained tokens, the per-token reverse KL there).

    All tensors [n, t] in one layout; `mask` 1 on trained tokens. Outside the mask the advantages are returned
    unchanged and the KL is 0. No gradient flows (the log-probs are detached).
    """
    import torch

    with torch.no_grad():
        m = mask.to(torch.float32)
        kl = (student_logp.detach().float() - teacher_logp.detach().float()) * m
        return advantages - kl_coef * kl.to(advantages.dtype), kl


def micro_batch_opd(mb, student_logp: torch.Tensor, kl_coef: float, teacher_logp_fn=None):
    """`opd_advantages` for one micro-batch (tasks/train/collation.py): the teacher's log-probs are the stored ones
    (opd_type sglang, or any replay of a run that stored them), else `teacher_logp_fn(mb)` (opd_type megatron's
    model in the trainer). Returns (advantages, per-token reverse KL)."""
    teacher = mb.teacher_logprobs
    if teacher is None and teacher_logp_fn is not None:
        teacher = teacher_logp_fn(mb)
    if teacher is None:
        raise RuntimeError(
            "use_opd: these samples have no teacher log-probs (the trajectories' teacher_logprobs column is null "
            "and no teacher model is loaded): score them with opd_type sglang, or use opd_type megatron"
        )
    return opd_advantages(mb.advantages, student_logp, teacher, mb.loss_mask, kl_coef)


class DistillationTerm:
    """--use-opd in the trainer, in one place: the advantage term and, with opd_type megatron, the frozen teacher
    model it owns (opd_type sglang's teacher is an engine; its log-probs arrive in the micro-batch).

    `logprobs(model, mb)` is the trainer's own log-prob function, so the teacher scores a micro-batch in the
    layout the student's log-probs have."""

    def __init__(self, opd: OpdPart, student_config, dtype: torch.dtype, device: torch.device, logprobs):
        self.kl_coef = opd.kl_coef
        self.teacher_model = None
        if not opd.engine:  # megatron: the teacher is a model of the trainer's
            self.teacher_model = build_teacher_model(opd.teacher_load, student_config, dtype, device)
        self._logprobs = logprobs

    @staticmethod
    def trainer_bytes(teacher_parameters: int | None, width: int) -> int:
        """Bytes the term holds on each trainer rank, counted without building it (the memory plan asks): the
        megatron teacher's weights at the trainer's compute width, `teacher_parameters` being its share on one TP
        rank (frozen: no gradients, no optimizer state); an engine's teacher (None) holds nothing here."""
        return 0 if teacher_parameters is None else teacher_parameters * width

    def _teacher_logp(self, mb) -> torch.Tensor | None:
        """The megatron teacher's log-probs of the micro-batch's tokens (its unscaled distribution), or None."""
        import torch

        if self.teacher_model is None:
            return None
        with torch.no_grad():
            return self._logprobs(self.teacher_model, mb)

    def shift(self, mb, student_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the micro-batch's advantages with the term applied, the per-token reverse KL): `micro_batch_opd`."""
        return micro_batch_opd(mb, student_logp, self.kl_coef, self._teacher_logp)


def build_teacher_model(source: str, student_config, dtype: torch.dtype, device: torch.device):
    """opd_type megatron: the frozen teacher GPTModel from an HF directory or zoo name (TP-sharded as the policy).

    Its architecture may differ from the student's (a larger model); its vocabulary may not: the log-probs of one
    token id must mean the same token for both. Raises ValueError naming both sizes when they differ.
    """
    from transformers import AutoConfig

    from sluiceway.models.hf_megatron import load_hf_weights
    from sluiceway.models.megatron_gpt import build_gpt_model
    from sluiceway.models.zoo import load_hf_state_dict, resolve_checkpoint

    path = resolve_checkpoint(source)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if config.vocab_size != student_config.vocab_size:
        raise ValueError(
            f"--opd-teacher-load {source}: vocabulary of {config.vocab_size} tokens, the student's has "
            f"{student_config.vocab_size}: the teacher must share the student's tokenizer"
        )
    model = build_gpt_model(config, dtype=dtype, device=device)
    load_hf_weights(model, load_hf_state_dict(path), config)
    return model.eval().requires_grad_(False)
