"""Format (shaping) reward: 1.0 when the response puts a non-empty answer where it was asked to.

Checks form only, never correctness; combine it with a correctness scorer (shaping.combine).
"""

from __future__ import annotations

import re

from sluiceway.tasks.reward.verifiers.boxed import last_boxed
from sluiceway.tasks.reward.verifiers.text import clip, prepare

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# The opening <think> is checked on the raw head: a long response's tail no longer holds it.
_THINK_END = re.compile(r"</think>\s*<answer>(.*?)</answer>\s*$", re.DOTALL | re.IGNORECASE)


def _boxed(text: str, head: str) -> str | None:
    return last_boxed(text)


def _answer_tag(text: str, head: str) -> str | None:
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def _think_answer(text: str, head: str) -> str | None:
    if not head.lstrip().lower().startswith("<think>"):
        return None
    m = _THINK_END.search(text)
    return m.group(1).strip() if m else None


FORMATS = {"boxed": _boxed, "answer_tag": _answer_tag, "think_answer": _think_answer}


def format_verify(
    response: object, label: object = None, formats: tuple[str, ...] = ("boxed", "answer_tag")
) -> tuple[float, dict]:
    """1.0 when any of `formats` holds a non-empty answer ("think_answer": the whole response is
    <think>...</think><answer>...</answer>). The label is ignored."""
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown formats {unknown} (known: {', '.join(FORMATS)})")
    text, head = prepare(response), ("" if response is None else str(response))[:1000]
    for name in formats:
        found = FORMATS[name](text, head)
        if found:
            return 1.0, {"pred": clip(found), "format": name}
    return 0.0, {"pred": None, "reason": f"no non-empty answer in format {' or '.join(formats)}"}
