"""Text preparation shared by all verifiers: bound the work, then undo Unicode tricks.

Only the last MAX_CHARS characters of a response are searched: final answers sit at the end, and a
1 MB response must not cost more than a short one (regexes and brace matching stay linear in a
bounded input).
"""

from __future__ import annotations

import re
import unicodedata

MAX_CHARS = 10_000
DETAIL_CHARS = 200  # extracted answers are clipped in details: they are stored with every sample

# Superscript digits would become plain digits under NFKC ("5²" -> "52"); keep them as powers.
_SUPERSCRIPTS = str.maketrans({c: f"^{d}" for d, c in enumerate("⁰¹²³⁴⁵⁶⁷⁸⁹")})
# Minus-like dashes NFKC leaves alone; U+2044 FRACTION SLASH comes from NFKC of "½".
_DASHES = str.maketrans({"\u2212": "-", "\u2012": "-", "\u2013": "-", "\u2044": "/"})
# Invisible format characters (zero-width space, joiners, BOM, soft hyphen) split "1\u200b0".
_INVISIBLE = re.compile("[\u00ad\u200b-\u200f\u2060-\u2064\ufeff]")


def tail(text: object, limit: int = MAX_CHARS) -> str:
    s = "" if text is None else str(text)
    return s[-limit:] if len(s) > limit else s


def normalize(text: str) -> str:
    """NFKC (fullwidth "１２" -> "12"), dashes -> "-", invisible characters dropped.

    Look-alike letters (Cyrillic "О", Latin "l") are left alone: digits are matched as ASCII [0-9]
    only, so they never count as numbers.
    """
    text = _INVISIBLE.sub("", text.translate(_SUPERSCRIPTS))
    return unicodedata.normalize("NFKC", text).translate(_DASHES)


def prepare(text: object) -> str:
    return normalize(tail(text))


def clip(s: str | None, n: int = DETAIL_CHARS) -> str | None:
    return s if s is None or len(s) <= n else s[: n - 1] + "…"
