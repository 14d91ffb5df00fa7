"""The bounds of Tinker's AdamParams: checked when an optim_step request comes in (a 400 naming the field) and again
when the step runs (flows/tinker/model.py), so no request can step the weights into ruin."""

from __future__ import annotations

import math

from sluiceway.flows.tinker.futures import TinkerUserError

# What an AdamW step may be told, (low, high, low allowed, high allowed) per field: beyond these one step destroys
# the weights (learning_rate 1e30), divides by zero (eps 0: a parameter whose gradient stays 0 gets 0/0) or
# turns the moments into something else than averages (a beta of 1 or more, or below 0).
ADAM_BOUNDS = {
    "learning_rate": (0.0, 1.0, True, True),
    "beta1": (0.0, 1.0, True, False),
    "beta2": (0.0, 1.0, True, False),
    "eps": (0.0, 1.0, False, True),
    "weight_decay": (0.0, 1.0, True, True),
    "grad_clip_norm": (0.0, math.inf, True, False),
}


def check_adam(params: dict) -> None:
    """A TinkerUserError naming the first AdamParams field out of `ADAM_BOUNDS`; before anything is stepped."""
    for name, (low, high, low_ok, high_ok) in ADAM_BOUNDS.items():
        if name not in params:
            continue
        value = params[name]
        ok = isinstance(value, int | float) and math.isfinite(value)
        ok = ok and (low <= value if low_ok else low < value) and (value <= high if high_ok else value < high)
        if not ok:
            span = f"{'[' if low_ok else '('}{low:g}, {high:g}{']' if high_ok else ')'}"
            raise TinkerUserError(f"optim_step: adam_params.{name} must be a finite number in {span}, got {value!r}")
