"""Final-answer extraction and comparison for math-style tasks (the `math` and `exact` rm types).

Kept as the stable entry point; the work is in verifiers/: the answer is the last \\boxed{} (or
\\fbox{}), else the last <answer> tag, "#### x" or "the answer is x", else the last number in the
text. Only the last verifiers.MAX_CHARS characters are searched.
"""

from __future__ import annotations

from fractions import Fraction

from sluiceway.tasks.reward.verifiers import boxed, extract, numbers
from sluiceway.tasks.reward.verifiers.exact import exact_verify
from sluiceway.tasks.reward.verifiers.math import DEFAULT_REL_TOL, math_verify
from sluiceway.tasks.reward.verifiers.text import prepare


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...}, braces balanced."""
    return boxed.last_boxed(prepare(text))


def extract_answer(text: str) -> str | None:
    return extract.extract_answer(prepare(text))


def to_number(s: str) -> Fraction | None:
    """Exact value of a number, fraction or LaTeX fraction; None for anything else."""
    return numbers.parse(prepare(s)).value


def math_reward(response: str, label: str, rel_tol: float = DEFAULT_REL_TOL) -> tuple[float, dict]:
    """1.0 when the extracted answer equals the label (numerically, within rel_tol, when both are numbers)."""
    return math_verify(response, label, rel_tol=rel_tol)


def exact_reward(response: str, label: str) -> tuple[float, dict]:
    return exact_verify(response, label)
