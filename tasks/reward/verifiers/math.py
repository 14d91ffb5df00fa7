"""Math final-answer verifier: extract, normalise, compare exactly or within a relative tolerance.

Several boxed answers: the LAST box is the answer (earlier ones are drafts), so boxing every option
cannot collect a reward for any but the last. With multiple="reject", more than one distinct boxed
answer scores 0 instead ("hedging").
"""

from __future__ import annotations

import re

from sluiceway.tasks.reward.verifiers.boxed import boxed_all
from sluiceway.tasks.reward.verifiers.extract import extract_with_method
from sluiceway.tasks.reward.verifiers.numbers import Parsed, candidates, canonical_unit, close, parse
from sluiceway.tasks.reward.verifiers.text import clip, normalize, prepare, tail

DEFAULT_REL_TOL = 1e-6
_WORDS = re.compile(r"[A-Za-z ]+")


def _label_text(label: object) -> str:
    s = normalize(tail(label)).strip()
    if "####" in s:  # a GSM8K solution as the label: its answer follows the last "####"
        s = s.rsplit("####", 1)[1].strip()
    return s


def _same_text(a: Parsed, b: Parsed) -> bool:
    x, y = a.text.replace(" ", ""), b.text.replace(" ", "")
    if _WORDS.fullmatch(a.text) and _WORDS.fullmatch(b.text):  # "Yes" == "yes"
        return x.casefold() == y.casefold()
    return x == y


def equivalent(pred: str, label: str, rel_tol: float = DEFAULT_REL_TOL, abs_tol: float = 0.0) -> tuple[bool, str]:
    """(equal?, how): numbers within tolerance ("50%" is 50 or 0.5), else normalised text."""
    p, g = parse(pred), parse(label)
    if p.unit and g.unit and canonical_unit(p.unit) != canonical_unit(g.unit):
        return False, "unit mismatch"  # the label's unit only counts when the answer gives a different one
    if g.value is not None and p.value is not None:
        ok = any(close(a, b, rel_tol, abs_tol) for a in candidates(p) for b in candidates(g))
        return ok, "numeric"
    return _same_text(p, g), "text"


def math_verify(
    response: object,
    label: object,
    rel_tol: float = DEFAULT_REL_TOL,
    abs_tol: float = 0.0,
    multiple: str = "last",
) -> tuple[float, dict]:
    """1.0 when the final answer equals the label; details: pred, method, how, n_boxed, reason."""
    text = prepare(response)
    gold = _label_text(label)
    if not gold:
        return 0.0, {"pred": None, "reason": "empty label"}
    pred, method = extract_with_method(text)
    details: dict = {"pred": clip(pred), "method": method}
    if pred is None:
        return 0.0, {**details, "reason": "no answer found"}
    if method == "boxed":
        boxes = boxed_all(text)
        distinct = {parse(b).text for b in boxes}
        details["n_boxed"] = len(boxes)
        if multiple == "reject" and len(distinct) > 1:
            return 0.0, {**details, "reason": f"{len(distinct)} different boxed answers"}
    ok, how = equivalent(pred, gold, rel_tol, abs_tol)
    details["how"] = how
    if not ok:
        details["reason"] = "unit mismatch" if how == "unit mismatch" else "wrong answer"
    return float(ok), details
