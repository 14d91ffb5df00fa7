"""Final-answer extraction, most explicit marker first.

Order: last \\boxed{}/\\fbox{} > last <answer>...</answer> > last "#### x" (GSM8K) > last "the answer
is x" / "answer: x" > last number in the text. Small models often ignore the requested format
("7 + 8 = 15"), hence the last-number fallback. Input is the prepared tail (see text.py).
"""

from __future__ import annotations

import re

from sluiceway.tasks.reward.verifiers.boxed import last_boxed
from sluiceway.tasks.reward.verifiers.numbers import parse

# A number as written in prose: \frac{a}{b}, 1,234.5, 3/4, 1.5e3, 50% (ASCII digits only).
NUMBER = re.compile(
    r"-?\\[dt]?frac\s*\{[^{}]*\}\s*\{[^{}]*\}|-?\\frac\d\d"
    r"|[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:/\d+(?:\.\d+)?)?(?:\\?%)?"
    r"|-?\.\d+",
    re.ASCII,
)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_HASHES = re.compile(r"####[ \t]*")
_ANSWER_IS = re.compile(r"\banswer\s*(?:is|was|:|=)\s*[:=]?[ \t]*", re.IGNORECASE)
_WRAP = re.compile(r"^(?:\*\*|\$\$?|\\\(|\\\[)\s*|\s*(?:\*\*|\$\$?|\\\)|\\\])$")


def _last(pattern: re.Pattern, text: str) -> re.Match | None:
    m = None
    for m in pattern.finditer(text):  # noqa: B007 - the loop keeps the last match
        pass
    return m


def _scope(rest: str) -> str:
    """The line after a marker; the next non-empty line when the marker ends its line ("answer:\\n 42")."""
    lines = rest.split("\n")
    first = lines[0].strip()
    if not first or first.endswith(":"):
        first = next((ln.strip() for ln in lines[1:] if ln.strip()), "")
    return first


def _from_scope(scope: str) -> str | None:
    """The whole scope when it is one number (with unit or %), else its first number, else its words."""
    scope = _WRAP.sub("", scope.strip()).strip().rstrip(".").strip()
    scope = _WRAP.sub("", scope).strip()
    if not scope:
        return None
    if parse(scope).value is not None:
        return scope
    m = NUMBER.search(scope)
    if m:
        return m.group()
    return re.split(r"(?<=\w)[.;!?](?:\s|$)", scope, maxsplit=1)[0].strip()[:100] or None  # "yes."


def structured_answer(text: str) -> tuple[str | None, str]:
    """(answer, how) from an explicit marker only; (None, "none") when the text has none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    m = _last(_ANSWER_TAG, text)
    if m:
        inner = m.group(1).strip()
        return (inner if parse(inner).value is not None else extract_answer(inner) or inner or None), "answer_tag"
    for how, pattern in (("####", _HASHES), ("answer_is", _ANSWER_IS)):
        m = _last(pattern, text)
        if m:
            found = _from_scope(_scope(text[m.end() :]))
            if found is not None:
                return found, how
    return None, "none"


def extract_with_method(text: str) -> tuple[str | None, str]:
    found, how = structured_answer(text)
    if found is not None:
        return found, how
    m = _last(NUMBER, text)
    return (m.group(), "last_number") if m else (None, "none")


def extract_answer(text: str) -> str | None:
    return extract_with_method(text)[0]
