"""The label is a regular expression; the answer must match it in full.

Python's re has no timeout, so the answer is capped at MAX_REGEX_INPUT characters (this bounds
polynomial backtracking). A pattern with a quantified group that itself holds a quantifier ("(a+)+",
the exponential kind) only gets answers up to MAX_NESTED_INPUT characters (2**20 steps at most).
Bad patterns and over-long answers score 0 with a reason; nothing raises.
"""

from __future__ import annotations

import functools
import re

from sluiceway.tasks.reward.verifiers.extract import structured_answer
from sluiceway.tasks.reward.verifiers.text import clip, prepare

MAX_REGEX_INPUT = 1_000
MAX_NESTED_INPUT = 20
MAX_PATTERN = 1_000
_NESTED_QUANTIFIER = re.compile(r"\((?:[^()\\]|\\.)*[+*}](?:[^()\\]|\\.)*\)\s*(?:[+*]|\{\d*,)")


@functools.lru_cache(maxsize=256)
def compile_label(pattern: str) -> tuple[re.Pattern, int] | str:
    """(compiled pattern, longest answer it may see), or why it is refused."""
    if len(pattern) > MAX_PATTERN:
        return f"pattern longer than {MAX_PATTERN} characters"
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        return f"bad regex: {e}"
    return compiled, MAX_NESTED_INPUT if _NESTED_QUANTIFIER.search(pattern) else MAX_REGEX_INPUT


def regex_verify(response: object, label: object, flags_ignorecase: bool = False) -> tuple[float, dict]:
    """Fullmatch the label against the extracted answer (boxed, <answer>, ####, "answer is"), else the
    whole stripped response."""
    pattern = "" if label is None else str(label)
    compiled = compile_label(("(?i)" if flags_ignorecase else "") + pattern)
    text = prepare(response)
    found, method = structured_answer(text)
    pred = (found if found is not None else text).strip()
    details: dict = {"pred": clip(pred), "method": method if found is not None else "whole"}
    if isinstance(compiled, str):
        return 0.0, {**details, "reason": compiled}
    if not pred:
        return 0.0, {**details, "reason": "empty answer"}
    compiled, limit = compiled
    if len(pred) > limit:
        return 0.0, {**details, "reason": f"answer longer than {limit} characters for this pattern"}
    ok = compiled.fullmatch(pred) is not None
    return float(ok), details if ok else {**details, "reason": "no match"}
