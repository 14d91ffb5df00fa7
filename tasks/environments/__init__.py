"""Procedural verifiable environments: named generators usable as `--prompt-data env:NAME`."""

from __future__ import annotations

from collections.abc import Callable

from sluiceway.flows.errors import UserError
from sluiceway.tasks.environments import arithmetic

ENVIRONMENTS: dict[str, Callable[..., list[dict]]] = {"arithmetic": arithmetic.generate}


def generate_env(spec: str, n: int, seed: int) -> list[dict]:
    """`spec` is 'env:NAME' or 'env:NAME:DIGITS' (e.g. env:arithmetic:2)."""
    parts = spec.split(":")
    name = parts[1] if len(parts) > 1 else ""
    if name not in ENVIRONMENTS:
        raise UserError(f"--prompt-data {spec}: unknown environment '{name}' (known: {', '.join(ENVIRONMENTS)})")
    kwargs = {}
    if len(parts) > 2:
        if not parts[2].isdigit() or int(parts[2]) < 1:
            raise UserError(f"--prompt-data {spec}: difficulty must be a positive integer")
        kwargs["digits"] = int(parts[2])
    return ENVIRONMENTS[name](n, seed, **kwargs)
