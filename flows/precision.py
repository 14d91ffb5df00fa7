"""The run's precision: `auto` resolved to what this machine computes well, and the one line that says why.

The measurement is models/precision.py's; this is the policy of a run: resolved by the CLI before the run record
is written and the engines start, logged when the run starts (after every check of the user's input passed).
"""

from __future__ import annotations

from sluiceway.flows.config import RunConfig
from sluiceway.infra import held_lines


def resolve_precision(cfg: RunConfig, announce: bool = True) -> RunConfig:
    """`cfg` with precision `auto` replaced by what this machine computes well (bf16 or fp32).

    The line saying what was chosen and why is held until the run starts (infra/held_lines.py: found when the CLI
    resolves `auto`, before it checks the data, so that engines started early load in the right dtype; logged
    once every check passed, so a user's mistake stays the only line printed), first among the held lines: the
    run's first line says what it computes in. `announce` also holds one for a precision asked for. Trainer,
    engines and published weight versions all read the resolved `training.bf16`.
    """
    t = cfg.training
    if t.precision == "auto":
        from sluiceway.models.precision import choose  # imports torch: only when a run starts

        choice = choose("auto", cfg.resources.device)
        held_lines.replace("precision", [f"precision: {choice.precision} ({choice.reason})"], first=True)
        training = t.model_copy(update={"precision": choice.precision, "bf16": choice.bf16})
        cfg = cfg.model_copy(update={"training": training})
    elif announce and not held_lines.held("precision"):
        held_lines.replace("precision", [f"precision: {t.precision} (asked for)"], first=True)
    return cfg
