"""What every procedural environment provides, plus answer-extraction helpers shared by the verifiers.

An environment is an object with

* ``name`` (str) and ``max_level`` (int, levels are 1..max_level) and ``levels`` ({level: what it means});
* ``generate(rng, level) -> record``: one record in slime's prompt format,
  ``{"input": text, "label": answer, "metadata": {"env": name, "level": level, ...}}``, drawing all its
  randomness from ``rng`` (a ``random.Random``) so a seed fixes the record;
* ``verify(response, label, metadata) -> (reward in [0, 1], details)``: the checker. It never raises on
  junk responses (None, empty, huge, unicode), never evaluates model text as code, and reads only
  ``label`` and the ``metadata`` its own generator wrote.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, Protocol, runtime_checkable

# Verifiers look at the tail of a response only: final answers come last and regexes stay cheap.
MAX_RESPONSE_CHARS = 16_000


@runtime_checkable
class Environment(Protocol):
    name: str
    max_level: int
    levels: dict[int, str]

    def generate(self, rng: random.Random, level: int) -> dict: ...

    def verify(self, response: str, label: str, metadata: dict) -> tuple[float, dict]: ...


def check_level(env: Environment, level: Any) -> int:
    if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= env.max_level:
        raise ValueError(f"{env.name}: level must be an integer in 1..{env.max_level}, got {level!r}")
    return level


def make_record(env: str, level: int, text: str, label: Any, **meta: Any) -> dict:
    return {"input": text, "label": str(label), "metadata": {"env": env, "level": level, **meta}}


def as_text(response: Any) -> str:
    """The response as a string (None -> ''), its tail only when huge."""
    if response is None:
        return ""
    if not isinstance(response, str):
        response = str(response)
    return response[-MAX_RESPONSE_CHARS:]


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_ANSWER_MARK = re.compile(r"\banswer\b\s*(?:is\b\s*:?|:|=)\s*", re.IGNORECASE)


def marked_answer(text: str) -> str | None:
    """The explicitly marked final answer: last \\boxed{}, last <answer></answer>, or what follows the last
    'answer:' / 'answer is'. None when the response marks nothing."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    marks = list(_ANSWER_MARK.finditer(text))
    if marks:
        rest = text[marks[-1].end() :].strip()
        return rest or None
    return None


def nonempty_lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


def final_answer(text: str) -> str | None:
    """The marked answer, else the last non-empty line, else None."""
    marked = marked_answer(text)
    if marked is not None:
        return marked
    lines = nonempty_lines(text)
    return lines[-1] if lines else None


_INT = re.compile(r"(?<![0-9])(?<![0-9]\.)-?[0-9]+(?!\.?[0-9])")


def final_integer(text: str) -> int | None:
    """The integer answer: the first integer of the marked answer, else the last integer in the text."""
    text = text.replace("\u2212", "-").replace(",", "")
    marked = marked_answer(text)
    if marked is not None:
        nums = _INT.findall(marked.rsplit("=", 1)[-1])
        return int(nums[0]) if nums and len(nums[0]) <= 40 else None
    nums = _INT.findall(text)
    if not nums or len(nums[-1]) > 40:
        return None
    return int(nums[-1])


def strip_wrapping(s: str) -> str:
    """Drop surrounding whitespace, quotes, backticks, bold markers and one trailing period."""
    s = s.strip()
    for _ in range(3):
        s = s.strip().strip("*").strip()
        if len(s) >= 2 and s[0] == s[-1] and s[0] in "\"'`":
            s = s[1:-1]
        elif len(s) >= 2 and (s[0], s[-1]) in {("“", "”"), ("‘", "’"), ("«", "»")}:
            s = s[1:-1]
    return s


def parse_metadata(metadata: Any) -> dict:
    """metadata as a dict: trajectory rows store it as a JSON string."""
    if isinstance(metadata, dict):
        return metadata
    if isinstance(metadata, str | bytes) and metadata:
        try:
            out = json.loads(metadata)
        except ValueError:
            return {}
        return out if isinstance(out, dict) else {}
    return {}
