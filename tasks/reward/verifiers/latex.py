"""Strip LaTeX presentation noise so "$\\dfrac{3}{4}$" and "3/4" compare equal."""

from __future__ import annotations

import re

_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}")
_FRAC_NAMES = re.compile(r"\\(?:dfrac|tfrac|cfrac)")
_FRAC = re.compile(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\frac\s*(\d)\s*(\d)")  # "\frac12"
_SQRT_SHORT = re.compile(r"\\sqrt\s*(\w)")  # "\sqrt2" -> "\sqrt{2}"
_SIMPLE = re.compile(r"[\w.\\]+")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree|°")
_NOISE = re.compile(r"\\left|\\right|\\displaystyle|\\[!,;:> ]|~|\\\$|\$|\\\(|\\\)|\\\[|\\\]")
_ASSIGN = re.compile(r"^[A-Za-z]\w*\s*=\s*(?=[^=]+$)")  # "x = 5" -> "5" (one "=" only)
_SPACES = re.compile(r"\s+")


def _frac(m: re.Match) -> str:
    num, den = m.group(1).strip(), m.group(2).strip()
    if _SIMPLE.fullmatch(num) and _SIMPLE.fullmatch(den):
        return f"{num}/{den}"
    return f"({num})/({den})"


def clean_latex(s: str) -> str:
    s = _WRAPPERS.sub(lambda m: f" {m.group(1)} ", s)
    s = _DEGREES.sub("", s)
    s = _NOISE.sub("", s)
    s = s.replace("{,}", ",").replace("\\%", "%")
    s = _FRAC_NAMES.sub(r"\\frac", s)
    s = _FRAC_SHORT.sub(r"\1/\2", s)
    for _ in range(3):  # nested fractions, innermost first
        s, n = _FRAC.subn(_frac, s)
        if not n:
            break
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    s = _SPACES.sub(" ", s).strip()
    s = _ASSIGN.sub("", s)
    s = s.rstrip(".").strip()
    while len(s) >= 2 and s[0] == "{" and s[-1] == "}" and "}" not in s[1:-1]:
        s = s[1:-1].strip()
    return s
