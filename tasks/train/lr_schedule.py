"""The learning-rate schedule: linear warmup, then constant, linear or cosine decay to min_lr.

`lr_schedule` gives the multiplier of `lr` at each optimizer step, for torch's LambdaLR; the policy and the PPO
critic step the same schedule (the critic at its own base lr).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from sluiceway.flows.config import TrainingConfig


def lr_factor(training: TrainingConfig, it: int, total_iters: int | None = None) -> float:
    """Multiplier of lr at optimizer step `it`: linear warmup, then constant, linear or cosine decay.

    Decay runs over lr_decay_iters steps (default: `total_iters`, the optimizer steps of the whole run).
    """
    t = training
    if t.lr_warmup_iters and it < t.lr_warmup_iters:
        return (it + 1) / t.lr_warmup_iters
    if t.lr_decay_style == "constant":
        return 1.0
    total = (t.lr_decay_iters or total_iters or 1) - t.lr_warmup_iters
    progress = min(max(it - t.lr_warmup_iters, 0) / max(total, 1), 1.0)
    floor = t.min_lr / t.lr
    shape = 1.0 - progress if t.lr_decay_style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * shape


def lr_schedule(training: TrainingConfig, total_iters: int | None = None) -> Callable[[int], float]:
    """The schedule as a function of the optimizer step (LambdaLR's lr_lambda). A partial, not a lambda: LambdaLR
    saves a non-function's (empty) __dict__, so checkpoints keep the scheduler state they had before this module."""
    return functools.partial(lr_factor, training, total_iters=total_iters)
