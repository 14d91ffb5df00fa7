"""Procedural verifiable environments: prompt generators that carry their own verifiers.

Each environment (see base.py for the interface) has integer difficulty levels 1..max_level and writes
``metadata = {"env": name, "level": level, ...}`` into every record, so the reward side can route a sample
back to the verifier that understands it (``verify_record`` / ``env_reward``).

``--prompt-data`` specs understood by ``generate_env(spec, n, seed)``:

* ``env:NAME`` - level 1 of one environment, e.g. ``env:countdown``;
* ``env:NAME:LEVEL`` - one level, e.g. ``env:arithmetic:3``;
* ``env:mix(NAME[:LEVEL][=WEIGHT],...)`` - a weighted mixture, e.g. ``env:mix(arithmetic:2=2,countdown=1)``
  (weights default to 1; quote it in a shell because of the parentheses). ``env:mix:NAME[:LEVEL][=WEIGHT],...``
  is the same without parentheses. Each environment gets ``round(n * weight / total)`` records (largest
  remainder, so they add up to n), in an order shuffled by the seed.

A seed fixes the records. ``env:arithmetic`` and ``env:arithmetic:2`` give exactly the records of the
original arithmetic generator (1- and 2-digit addition), plus ``level`` in the metadata.
"""

from __future__ import annotations

import random
import re
from typing import Any

from sluiceway.infra.errors import UserError
from sluiceway.infra.prompt_sources import ENV, source_body, source_kind
from sluiceway.tasks.environments import arithmetic, countdown, counting, logic, reverse, sorting
from sluiceway.tasks.environments.base import Environment, as_text, parse_metadata

ENVIRONMENTS: dict[str, Environment] = {
    env.name: env for env in (arithmetic.ENV, countdown.ENV, sorting.ENV, reverse.ENV, counting.ENV, logic.ENV)
}

__all__ = [
    "ENVIRONMENTS",
    "Environment",
    "env_reward",
    "generate_env",
    "generate_records",
    "parse_spec",
    "verify_record",
]

_ITEM = re.compile(r"^([a-z_][a-z0-9_]*)(?::(\d+))?(?:=([0-9]*\.?[0-9]+))?$")


def _check(spec: str, name: str, level: int | None) -> tuple[str, int]:
    if name not in ENVIRONMENTS:
        raise UserError(f"--prompt-data {spec}: unknown environment '{name}' (known: {', '.join(ENVIRONMENTS)})")
    env = ENVIRONMENTS[name]
    level = 1 if level is None else level
    if not 1 <= level <= env.max_level:
        raise UserError(f"--prompt-data {spec}: {name} has levels 1..{env.max_level}, got {level}")
    return name, level


def parse_spec(spec: str) -> list[tuple[str, int, float]]:
    """`env:...` -> [(name, level, weight), ...]; a single environment has weight 1."""
    if source_kind(spec) != ENV:
        raise UserError(f"--prompt-data {spec}: an environment spec starts with 'env:'")
    body = source_body(spec).strip()
    if body.startswith("mix(") and body.endswith(")"):
        items = body[4:-1]
    elif body.startswith("mix:"):
        items = body[4:]
    else:
        parts = body.split(":")
        if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
            raise UserError(f"--prompt-data {spec}: expected env:NAME or env:NAME:LEVEL (LEVEL a positive integer)")
        name, level = _check(spec, parts[0], int(parts[1]) if len(parts) == 2 else None)
        return [(name, level, 1.0)]
    out = []
    for item in items.split(","):
        m = _ITEM.match(item.strip())
        if not m:
            raise UserError(
                f"--prompt-data {spec}: mixture item {item.strip()!r} is not NAME[:LEVEL][=WEIGHT] "
                "(e.g. env:mix(arithmetic:2=3,countdown=1))"
            )
        name, level = _check(spec, m.group(1), int(m.group(2)) if m.group(2) else None)
        weight = float(m.group(3)) if m.group(3) else 1.0
        if weight > 0:
            out.append((name, level, weight))
    if not out:
        raise UserError(f"--prompt-data {spec}: a mixture needs at least one environment with a positive weight")
    return out


def apportion(n: int, weights: list[float]) -> list[int]:
    """Split n into integer counts proportional to weights (largest remainder; ties to the earlier item)."""
    total = sum(weights)
    exact = [n * w / total for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


def generate_records(components: list[tuple[str, int]], n: int, seed: int, weights: list[float] | None = None):
    """n records from (env name, level) components in proportion to weights, deterministic in seed.

    Records are drawn from one random stream seeded with `seed` (so a single component reproduces a plain
    generator); which component each record comes from is shuffled by a second stream.
    """
    weights = weights if weights is not None else [1.0] * len(components)
    if len(components) == 1:
        slots = [0] * n
    else:
        slots = [k for k, c in enumerate(apportion(n, weights)) for _ in range(c)]
        random.Random(f"mix:{seed}").shuffle(slots)
    rng = random.Random(seed)
    records = []
    for i, k in enumerate(slots):
        name, level = components[k]
        rec = ENVIRONMENTS[name].generate(rng, level)
        rec["metadata"]["index"] = i
        records.append(rec)
    return records


def generate_env(spec: str, n: int, seed: int) -> list[dict]:
    """Records for an `env:...` spec (see the module docstring)."""
    parsed = parse_spec(spec)
    return generate_records([(name, level) for name, level, _ in parsed], n, seed, [w for *_, w in parsed])


def verify_record(response: Any, label: Any, metadata: Any) -> tuple[float, dict]:
    """Score a response with the verifier of the environment that made the record (metadata['env'])."""
    meta = parse_metadata(metadata)
    name = meta.get("env")
    env = ENVIRONMENTS.get(name) if isinstance(name, str) else None
    if env is None:
        return 0.0, {"reason": f"metadata names no known environment (env={name!r})"}
    try:
        reward, details = env.verify(as_text(response), "" if label is None else str(label), meta)
    except Exception as e:  # a verifier bug must not look like a right answer
        return 0.0, {"env": name, "reason": f"verifier error: {type(e).__name__}: {e}"[:500]}
    reward = min(1.0, max(0.0, float(reward)))
    return reward, {"env": name, "level": meta.get("level"), **details}


def env_reward(response: Any, label: Any, sample: Any = None) -> tuple[float, dict]:
    """A scorer (response, label, sample) -> (reward, details) for rm type 'env'.

    `sample` is a trajectory row (its 'metadata' a JSON string) or a record (metadata a dict)."""
    meta = sample.get("metadata") if isinstance(sample, dict) else None
    return verify_record(response, label, meta)
