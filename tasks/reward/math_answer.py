"""Final-answer extraction and comparison for math-style tasks.

Small models often ignore the requested format ("7 + 8 = 15"), so the answer is the last \\boxed{}
if there is one, else what follows "answer is", else the last number in the text.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*(.+)", re.IGNORECASE | re.DOTALL)


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    m = _ANSWER_IS.search(text)
    scope = m.group(1) if m else text
    nums = _NUMBER.findall(scope)
    if not nums:
        return None
    return nums[0] if m else nums[-1]


def to_number(s: str) -> Fraction | None:
    s = s.strip().strip("$ ").rstrip(".").replace(",", "")
    frac = re.fullmatch(r"\\frac\{(-?\d+)\}\{(\d+)\}", s)
    if frac:
        s = f"{frac.group(1)}/{frac.group(2)}"
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def math_reward(response: str, label: str) -> tuple[float, dict]:
    """1.0 when the extracted answer equals the label (numerically when both are numbers)."""
    pred = extract_answer(response)
    if pred is None:
        return 0.0, {"pred": None, "reason": "no answer found"}
    a, b = to_number(pred), to_number(str(label))
    ok = (a == b) if (a is not None and b is not None) else pred.strip() == str(label).strip()
    return float(ok), {"pred": pred}


def exact_reward(response: str, label: str) -> tuple[float, dict]:
    return float(response.strip() == str(label).strip()), {}
