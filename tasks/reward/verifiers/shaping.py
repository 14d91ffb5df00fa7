"""Composing scorers: a weighted mix (e.g. math + format) and a linear length penalty.

A scorer here is (response, label) -> (reward in [0, 1], details); both helpers return one, so they nest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Verifier = Callable[[object, object], tuple[float, dict]]


def length_penalty(length: int, budget: int, window: int) -> float:
    """0 up to `budget`, rising linearly to 1 at `budget + window`."""
    if length <= budget:
        return 0.0
    return min(1.0, (length - budget) / max(window, 1))


def with_length_penalty(scorer: Verifier, budget: int, window: int, count: Callable[[str], int] = len) -> Verifier:
    """scorer's reward times (1 - penalty): a correct but rambling answer earns less, never below 0.

    `count` measures length: characters by default; pass e.g. `lambda s: len(tok.encode(s))` for tokens.
    """

    def scored(response: object, label: object) -> tuple[float, dict]:
        reward, details = scorer(response, label)
        n = count("" if response is None else str(response))
        penalty = length_penalty(n, budget, window)
        out = {**details, "length": n, "length_penalty": penalty, "unpenalized_reward": reward}
        return reward * (1.0 - penalty), out

    return scored


def combine(scorers: Sequence[Verifier], weights: Sequence[float] | None = None) -> Verifier:
    """Weighted mean of the scorers' rewards (weights are normalised, so the result stays in [0, 1]).

    Details: the first scorer's (its `pred` and `reason`), plus each part's reward and details under
    "parts".
    """
    if not scorers:
        raise ValueError("combine needs at least one scorer")
    weights = list(weights) if weights is not None else [1.0] * len(scorers)
    if len(weights) != len(scorers) or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError("combine needs one non-negative weight per scorer, not all zero")
    total = float(sum(weights))

    def scored(response: object, label: object) -> tuple[float, dict]:
        results = [s(response, label) for s in scorers]
        reward = sum(w * r for w, (r, _) in zip(weights, results)) / total
        parts = [{"reward": r, "weight": w, **d} for w, (r, d) in zip(weights, results)]
        details = {**results[0][1], "parts": parts}
        if reward > 0:
            details.pop("reason", None)
        return min(1.0, max(0.0, reward)), details

    return scored
