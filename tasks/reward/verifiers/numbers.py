"""Turning a cleaned answer into (exact value, percent?, unit) and comparing values with a tolerance."""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from sluiceway.tasks.reward.verifiers.latex import clean_latex

# Bounds so a hostile "1e999999999" or a 5,000-digit number cannot make Fraction do unbounded work.
MAX_NUMBER_CHARS = 100
MAX_EXPONENT = 300

_NUM = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_PLAIN = re.compile(rf"[+-]?{_NUM}", re.ASCII)
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", re.ASCII)
_RATIO = re.compile(rf"([+-]?)\(?([+-]?{_NUM})\)?\s*/\s*\(?([+-]?{_NUM})\)?", re.ASCII)
_SCI = re.compile(rf"([+-]?{_NUM})\s*(?:\\times|\\cdot|×|\*|x)\s*10\s*\^\s*\{{?\s*([+-]?\d+)\s*\}}?", re.ASCII)
_EXP = re.compile(r"[eE]([+-]?\d+)", re.ASCII)

# A trailing unit: one to three words of letters (with "/", "per", "^2"), e.g. "km/h", "square feet".
_UNIT_WORD = r"[A-Za-z]{1,15}(?:\^\d)?"
_UNIT = re.compile(rf"({_UNIT_WORD}(?:\s*(?:/|per\s)\s*{_UNIT_WORD}|\s+{_UNIT_WORD}){{0,2}})$", re.ASCII)
# Single letters are units only from this list ("5 x" is algebra); these words are never units.
_ONE_LETTER_UNITS = set("mgshlLK")
_NOT_UNITS = {"and", "or", "to", "by", "times", "plus", "minus", "over", "sqrt", "pi", "infty", "inf", "mod", "i"}
_UNIT_ALIASES = {
    "hr": "hour",
    "hrs": "hour",
    "h": "hour",
    "min": "minute",
    "mins": "minute",
    "sec": "second",
    "secs": "second",
    "s": "second",
    "dollar": "$",
    "usd": "$",
    "kph": "km/h",
    "kmh": "km/h",
}


@dataclass(frozen=True)
class Parsed:
    text: str  # cleaned text without the unit (and without "%")
    value: Fraction | None
    percent: bool = False
    unit: str | None = None


def _exponent_ok(s: str) -> bool:
    return all(abs(int(e)) <= MAX_EXPONENT for e in _EXP.findall(s))


def to_fraction(s: str) -> Fraction | None:
    """Exact value of a plain, thousands-separated, scientific or a/b number; None otherwise."""
    s = s.strip()
    if not s or len(s) > MAX_NUMBER_CHARS:
        return None
    try:
        if _PLAIN.fullmatch(s) and _exponent_ok(s):
            return Fraction(s)
        if _THOUSANDS.fullmatch(s):
            return Fraction(s.replace(",", ""))
        m = _SCI.fullmatch(s)
        if m and _exponent_ok(m.group(1)) and abs(int(m.group(2))) <= MAX_EXPONENT:
            return Fraction(m.group(1)) * Fraction(10) ** int(m.group(2))
        m = _RATIO.fullmatch(s)
        if m and _exponent_ok(s):
            value = Fraction(m.group(2)) / Fraction(m.group(3))
            return -value if m.group(1) == "-" else value
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _split_unit(s: str) -> tuple[str, str | None]:
    m = _UNIT.search(s)
    if not m or m.start() == 0:
        return s, None
    body, unit = s[: m.start()].rstrip(), m.group(1)
    words = re.findall(r"[A-Za-z]+", unit)
    if any(w.lower() in _NOT_UNITS for w in words) or (len(unit) == 1 and unit not in _ONE_LETTER_UNITS):
        return s, None
    if to_fraction(body) is None:  # units only follow numbers: "\sqrt{2} cm" stays as text
        return s, None
    return body, unit


def canonical_unit(unit: str) -> str:
    u = re.sub(r"\s+", " ", unit.lower()).replace(" per ", "/")
    u = _UNIT_ALIASES.get(u, u)
    return u[:-1] if len(u) > 3 and u.endswith("s") else u


def parse(answer: str) -> Parsed:
    s = clean_latex(answer)
    if s.startswith("$"):
        s = s[1:].strip()
    percent = s.endswith("%")
    if percent:
        s = s[:-1].strip()
    value = to_fraction(s)
    unit = None
    if value is None and not percent:
        body, unit = _split_unit(s)
        if unit is not None:
            s, value = body, to_fraction(body)
    return Parsed(s, value, percent, unit)


def candidates(p: Parsed) -> list[Fraction]:
    """ "50%" may mean 50 or 0.5: labels are written both ways."""
    if p.value is None:
        return []
    return [p.value, p.value / 100] if p.percent else [p.value]


def close(a: Fraction, b: Fraction, rel_tol: float, abs_tol: float = 0.0) -> bool:
    if a == b:
        return True
    scale = max(abs(a), abs(b))
    return abs(a - b) <= max(Fraction(rel_tol) * scale, Fraction(abs_tol))
