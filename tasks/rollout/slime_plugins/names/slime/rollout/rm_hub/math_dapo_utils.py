"""slime.rollout.rm_hub.math_dapo_utils: DAPO's math grader, with slime's functions and return shapes
(`compute_score(solution_str, ground_truth, strict_box_verify=False, pause_tokens_index=None)` ->
`{"score": 1.0 | -1.0, "acc": bool, "pred": str | None}`), as slime's retool example imports it.

Two ways to grade, both on the last 300 characters of the solution:
- Minerva's (the default): the text after the last `Answer:` on its line, normalised by the rules of the
  Minerva paper's appendix (Lewkowycz et al., 2022: the final `=` side, units and filler words dropped, `$`,
  `\\text{}`, `\\boxed{}` unwrapped, shorthand `\\frac12`/`\\sqrt2` braced, digit-group commas removed), against the
  label as an integer (DAPO's answers are integers; a label that is not one raises ValueError, as in slime).
- strict boxed (`strict_box_verify=True`): the content of the last `\\boxed{}` in the final 100 characters (after
  the 4th pause token when `pause_tokens_index` is given), compared as written; 1 or -1.

Written for sluiceway from the published rules and slime's interface; a grade can differ from slime's only
where these normalisation rules are ambiguous.
"""

from __future__ import annotations

import re

# Minerva's normalisation tables (the paper's appendix D): replaced first, in order, then removed.
_REPLACE = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)  # fmt: skip
_UNITS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples",
)  # fmt: skip
_MARKUP = (
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}",
    "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots", "<|im_end|>", "<|endoftext|>",
)  # fmt: skip
_UNWRAP = (r"\\text\{(.*?)\}", r"\\textbf\{(.*?)\}", r"\\overline\{(.*?)\}")


def last_boxed_only_string(string: str) -> str | None:
    """The last `\\boxed{...}` of `string` with its braces balanced, or None (no box, or one never closed)."""
    start = string.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(string)):
        depth += {"{": 1, "}": -1}.get(string[i], 0)
        if string[i] == "}" and depth == 0:
            return string[start : i + 1]
    return None


def remove_boxed(s: str) -> str:
    """`\\boxed{x}` -> `x`; anything else is an AssertionError, as in slime."""
    prefix = "\\boxed{"
    assert s.startswith(prefix) and s.endswith("}"), f"box error: {s}"
    return s[len(prefix) : -1]


def normalize_final_answer(final_answer: str) -> str:
    """Minerva's normalisation of a final answer (the module's docstring)."""
    text = str(final_answer).split("=")[-1]
    for old, new in _REPLACE:
        text = text.replace(old, new)
    for gone in (*_UNITS, *_MARKUP):
        text = text.replace(gone, "")
    text = re.sub(r"(.*?)\$(.*?)\$(.*)", r"$\2$", text)  # each line: its first $...$ alone, if it has one
    for pattern in _UNWRAP:
        text = re.sub(pattern, r"\1", text)
    text = re.sub(r"\\boxed\{(.*)\}", r"\1", text)
    text = re.sub(r"frac([^{])(.)", r"frac{\1}{\2}", text)  # \frac12 -> \frac{1}{2}
    text = re.sub(r"sqrt([^{])", r"sqrt{\1}", text)  # \sqrt2 -> \sqrt{2}
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def is_correct_minerva(
    solution_str: str, gt: str, gt_need_extract: bool = False, answer_pattern: str = r"(?i)Answer\s*:\s*([^\n]+)"
) -> tuple[bool, str]:
    """Whether the last `Answer:` of the solution equals the (integer) label; and the normalised prediction."""
    found = re.findall(answer_pattern, solution_str)
    pred = normalize_final_answer(found[-1] if found else "[INVALID]")
    gold = normalize_final_answer(remove_boxed(last_boxed_only_string(gt)) if gt_need_extract else gt)
    gold = str(int(float(gold)))
    return pred == gold, pred


def is_correct_strict_box(pred: str, gt: str, pause_tokens_index: list[int] | None = None) -> tuple[int, str | None]:
    """(1 or -1, the boxed content) for the last `\\boxed{}` near the end of `pred`, compared as written."""
    if pause_tokens_index is not None:
        assert len(pause_tokens_index) == 4
        tail = pred[pause_tokens_index[-1] - 100 :]
    else:
        tail = pred[-100:]
    boxed = last_boxed_only_string(tail)
    extracted = remove_boxed(boxed) if boxed is not None else None
    return (1 if extracted == gt else -1), extracted


def verify(
    solution_str: str, answer: str, strict_box_verify: bool = False, pause_tokens_index: list[int] | None = None
) -> tuple[bool, str | None]:
    """(correct, prediction) by the strict boxed rule or Minerva's."""
    if strict_box_verify:
        score, pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
        return score == 1, pred
    return is_correct_minerva(solution_str, answer)


def compute_score(
    solution_str: str, ground_truth: str, strict_box_verify: bool = False, pause_tokens_index: list[int] | None = None
) -> dict:
    """{"score": 1.0 right / -1.0 wrong, "acc": right, "pred": the prediction} on the solution's last 300 chars."""
    correct, pred = verify(solution_str[-300:], ground_truth, strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
