"""Verifier hub: rule-based scorers (response, label) -> (reward in [0, 1], details).

details always has "pred" (what was extracted, clipped to 200 characters) and, when the reward is 0
for a structural reason (nothing extracted, bad label, bad pattern), "reason". Only the last
text.MAX_CHARS characters of a response are searched (exact compares the whole text).
"""

from __future__ import annotations

from sluiceway.tasks.reward.verifiers.boxed import boxed_all, last_boxed
from sluiceway.tasks.reward.verifiers.choice import choice_verify, extract_choice
from sluiceway.tasks.reward.verifiers.exact import exact_verify
from sluiceway.tasks.reward.verifiers.extract import extract_answer, extract_with_method, structured_answer
from sluiceway.tasks.reward.verifiers.f1 import f1_verify, token_f1
from sluiceway.tasks.reward.verifiers.format import format_verify
from sluiceway.tasks.reward.verifiers.math import equivalent, math_verify
from sluiceway.tasks.reward.verifiers.regex import regex_verify
from sluiceway.tasks.reward.verifiers.shaping import combine, length_penalty, with_length_penalty
from sluiceway.tasks.reward.verifiers.text import MAX_CHARS, normalize, prepare

# rm types; math+format: 0.9 for the right answer, 0.1 for answering in \boxed{} or <answer>.
VERIFIERS = {
    "math": math_verify,
    "exact": exact_verify,
    "regex": regex_verify,
    "f1": f1_verify,
    "choice": choice_verify,
    "format": format_verify,
    "math+format": combine([math_verify, format_verify], [0.9, 0.1]),
}

__all__ = [
    "MAX_CHARS",
    "VERIFIERS",
    "boxed_all",
    "choice_verify",
    "combine",
    "equivalent",
    "exact_verify",
    "extract_answer",
    "extract_choice",
    "extract_with_method",
    "f1_verify",
    "format_verify",
    "last_boxed",
    "length_penalty",
    "math_verify",
    "normalize",
    "prepare",
    "regex_verify",
    "structured_answer",
    "token_f1",
    "with_length_penalty",
]
