"""The run's precision: `auto` resolved to what this machine computes well, and the one line that says why.

The measurement is infra/precision.py's; this is the policy of a run: resolved by the CLI before the run record
is written and the engines start, logged when the flow starts (after every check of the user's input passed).
"""

from __future__ import annotations

import logging

from sluiceway.flows.config import RunConfig

log = logging.getLogger("sluiceway")

# Why a run computes in what it does, by run id: found when the CLI resolves `auto` (before it checks the data, so
# that engines started early load in the right dtype) and logged when the flow starts, after every check passed,
# so a user's mistake stays the only line printed.
_PRECISION_NOTES: dict[str, str] = {}


def resolve_precision(cfg: RunConfig, announce: bool = True) -> RunConfig:
    """`cfg` with precision `auto` replaced by what this machine computes well (bf16 or fp32).

    `announce` logs one line saying what was chosen and why. Trainer, engines and published weight versions all
    read the resolved `training.bf16`.
    """
    t = cfg.training
    if t.precision == "auto":
        from sluiceway.infra.precision import choose  # imports torch: only when a run starts

        choice = choose("auto", cfg.resources.device)
        _PRECISION_NOTES[cfg.run_id] = f"precision: {choice.precision} ({choice.reason})"
        training = t.model_copy(update={"precision": choice.precision, "bf16": choice.bf16})
        cfg = cfg.model_copy(update={"training": training})
    if announce:
        log.info(_PRECISION_NOTES.pop(cfg.run_id, f"precision: {cfg.training.precision} (asked for)"))
    return cfg
