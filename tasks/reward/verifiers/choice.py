"""Multiple choice: one option letter A-E, from "\\boxed{C}", "Answer: C" / "the answer is (C)", or a
final "(C)" / "C." / "C". Upper case only: "the answer is a ..." is an article, not option A.

Hedging ("Answer: A, B or C") scores 0; look-alike letters (Cyrillic "С") are not letters A-E.
"""

from __future__ import annotations

import re

from sluiceway.tasks.reward.verifiers.boxed import last_boxed
from sluiceway.tasks.reward.verifiers.text import clip, normalize, prepare, tail

LETTERS = "ABCDE"
_OPTION = r"\(?([A-E])\)?(?![A-Za-z0-9])"
_SINGLE = re.compile(rf"\s*(?:\\text\{{)?\s*(?:option\s*)?{_OPTION}\}}?\s*[.:)]?\s*", re.ASCII)
_ANSWER = re.compile(rf"(?i:\banswer\s*(?:is|:)\s*[:=]?\s*(?:option\s*)?)\**{_OPTION}")
_HEDGE = re.compile(rf"\s*(?:,|/|;|&|\bor\b|\band\b)\s*(?:option\s*)?{_OPTION}", re.ASCII)
_FINAL = re.compile(rf"(?<![A-Za-z0-9]){_OPTION}\**[.)]?\s*$", re.ASCII)


def _letter(s: str) -> str | None:
    m = _SINGLE.fullmatch(s)
    return m.group(1) if m else None


def extract_choice(text: str) -> tuple[str | None, str]:
    """(letter, how) or (None, reason)."""
    boxed = last_boxed(text)
    if boxed is not None:
        letter = _letter(boxed)
        return (letter, "boxed") if letter else (None, "boxed content is not one option letter")
    matches = list(_ANSWER.finditer(text))
    if matches:
        m = matches[-1]
        if _HEDGE.match(text, m.end()):
            return None, "several options given"
        return m.group(1), "answer_is"
    m = _FINAL.search(text.rstrip())
    if m:
        return m.group(1), "final"
    return None, "no option letter found"


def choice_verify(response: object, label: object) -> tuple[float, dict]:
    gold = _letter(normalize(tail(label)).strip().upper()) if label is not None else None
    if gold is None:
        return 0.0, {"pred": None, "reason": f"label {clip(str(label), 20)!r} is not one of {LETTERS}"}
    letter, how = extract_choice(prepare(response))
    if letter is None:
        return 0.0, {"pred": None, "reason": how}
    ok = letter == gold
    details: dict = {"pred": letter, "method": how}
    return float(ok), details if ok else {**details, "reason": "wrong option"}
