"""Exact match of the whole (stripped) response against the label."""

from __future__ import annotations

from sluiceway.tasks.reward.verifiers.text import clip, normalize


def exact_verify(response: object, label: object, casefold: bool = False, unicode: bool = False) -> tuple[float, dict]:
    """Backward compatible: by default only surrounding whitespace is ignored (no tail cap: whole text).

    casefold=True ignores case; unicode=True applies NFKC first (fullwidth letters match).
    """
    a, b = ("" if response is None else str(response)).strip(), ("" if label is None else str(label)).strip()
    if unicode:
        a, b = normalize(a), normalize(b)
    if casefold:
        a, b = a.casefold(), b.casefold()
    details: dict = {"pred": clip(a)}
    if not a:
        return 0.0, {**details, "reason": "empty response"}
    ok = a == b
    return float(ok), details if ok else {**details, "reason": "no exact match"}
