"""`TrainSample`, what training consumes, and the check every step runs on its samples before the optimizer.

Training imports this and nothing of the buffer: the samples are built from the trajectory rows by
tasks/train/batch.py (RL) or tasks/train/sft_data.py (SFT), in the flow's process, and handed to the trainer
(which may be a torchrun group on a machine without the store; tests/unit/repo/test_layering.py keeps it so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sluiceway.infra.errors import Fault


class NonFiniteTraining(Fault, FloatingPointError):
    """A NaN or inf on its way into an optimizer step: the step is refused before the weights change, and the
    message (one line on the terminal, flows/faults.py) names the step and, where one is to blame, the sample."""


def sample_name(group_id: int | None, sample_index: int | None) -> str:
    return "" if group_id is None else f" (group {group_id}, sample {sample_index})"


@dataclass
class TrainSample:
    """One trained sequence: a prompt, its response with per-token loss mask and rollout log-probs, an advantage."""

    prompt_token_ids: list[int]
    response_token_ids: list[int]
    loss_mask: list[int]  # per response token
    advantage: float
    rollout_logprobs: list[float]  # per response token, from the engine
    reward: float = 0.0  # the token-level estimators (ppo, reinforce_plus_plus) compute advantages from it
    teacher_logprobs: list[float] | None = None  # per response token, on-policy distillation's teacher (stored)
    group_id: int | None = None  # the trajectory row it came from, to name it in an error (None: not a row)
    sample_index: int | None = None

    @property
    def name(self) -> str:
        return sample_name(self.group_id, self.sample_index)


def _finite(values) -> bool:
    """All finite: one C-level sum (NaN or inf anywhere makes it non-finite; log-probs never reach overflow)."""
    return math.isfinite(sum(values))


def check_samples(samples: list[TrainSample], step: int) -> None:
    """Refuse a step whose inputs hold a NaN or inf (reward, advantage, rollout or teacher log-prob), naming the
    first such sample: masked-out positions are multiplied by 0 in the losses, and NaN * 0 is NaN."""
    for s in samples:
        for what, values in (
            ("reward", [s.reward]),
            ("advantage", [s.advantage]),
            ("rollout log-prob", s.rollout_logprobs),
            ("teacher log-prob", s.teacher_logprobs or ()),
        ):
            bad = None if _finite(values) else next((v for v in values if not math.isfinite(v)), None)
            if bad is not None:
                raise NonFiniteTraining(
                    f"train: step {step}{s.name} has a non-finite {what} {bad!r}; refused before the optimizer "
                    f"step (the weights are unchanged). Fix its cause, then `sluiceway resume` trains the step again"
                )
