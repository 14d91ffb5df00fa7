"""Choosing a scorer: a built-in by --rm-type, or the user's function by --custom-rm-path."""

from __future__ import annotations

from collections.abc import Callable

from sluiceway.flows.errors import UserError
from sluiceway.flows.plugins import load_function
from sluiceway.tasks.reward.math_answer import exact_reward, math_reward

# A scorer takes (response_text, label, sample) and returns a float or (float, details dict).
Scorer = Callable[..., float | tuple[float, dict]]

BUILTIN: dict[str, Callable[[str, str], tuple[float, dict]]] = {"math": math_reward, "exact": exact_reward}


def load_custom(path: str) -> Scorer:
    return load_function(path, "--custom-rm-path")


def get_scorer(rm_type: str, custom_rm_path: str | None) -> Callable:
    """A per-sample scorer; its result (float, (float, details) or dict) is interpreted by reward/score.py."""
    if custom_rm_path:
        return load_custom(custom_rm_path)  # (response, label, sample) or, with --group-rm, whole groups
    if rm_type not in BUILTIN:
        raise UserError(f"--rm-type {rm_type}: unknown (built-in: {', '.join(BUILTIN)}; or use --custom-rm-path)")
    builtin = BUILTIN[rm_type]
    return lambda response, label, sample: builtin(response, label)
