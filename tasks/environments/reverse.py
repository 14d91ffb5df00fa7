"""Reverse a string character by character; the label is the reversed string.

Levels:

1. one word of at most 5 letters
2. one word of 6 or more letters
3. 8-12 random lowercase letters
4. two or three words separated by single spaces (the whole string is reversed, spaces included)
5. 12-20 random letters (mixed case) and digits
6. 25-40 random letters (mixed case), digits and single spaces

The verifier reads the marked answer (\\boxed{}, <answer>, 'answer:'), else the last line (its last
double-quoted part if any, else what follows its last colon), strips quotes, backticks and a trailing
period, collapses runs of whitespace, and compares exactly (case-sensitive).
"""

from __future__ import annotations

import random
import re
import string

from sluiceway.tasks.environments.base import (
    as_text,
    check_level,
    make_record,
    marked_answer,
    nonempty_lines,
    strip_wrapping,
)
from sluiceway.tasks.environments.words import WORDS

SHORT = [w for w in WORDS if len(w) <= 5]
LONG = [w for w in WORDS if len(w) >= 6]
ALNUM = string.ascii_letters + string.digits
_QUOTED = re.compile(r'"([^"]*)"|“([^”]*)”')


def _random_text(rng: random.Random, n: int, alphabet: str, spaces: bool) -> str:
    chars = [rng.choice(alphabet) for _ in range(n)]
    if spaces:
        for i in range(2, n - 2, 1):
            if rng.random() < 0.15 and chars[i - 1] != " ":
                chars[i] = " "
    return "".join(chars)


class ReverseEnv:
    name = "reverse"
    levels = {
        1: "one word of at most 5 letters",
        2: "one word of 6 or more letters",
        3: "8-12 random lowercase letters",
        4: "two or three words with spaces",
        5: "12-20 random letters (mixed case) and digits",
        6: "25-40 random letters, digits and spaces",
    }
    max_level = len(levels)

    def generate(self, rng: random.Random, level: int) -> dict:
        check_level(self, level)
        if level == 1:
            s = rng.choice(SHORT)
        elif level == 2:
            s = rng.choice(LONG)
        elif level == 3:
            s = _random_text(rng, rng.randint(8, 12), string.ascii_lowercase, False)
        elif level == 4:
            s = " ".join(rng.sample(WORDS, rng.randint(2, 3)))
        elif level == 5:
            s = _random_text(rng, rng.randint(12, 20), ALNUM, False)
        else:
            s = _random_text(rng, rng.randint(25, 40), ALNUM, True)
        text = (
            f'Reverse the string "{s}" character by character (the last character first). '
            "Reply with just the reversed string."
        )
        return make_record(self.name, level, text, s[::-1], original=s)

    def verify(self, response: str, label: str, metadata: dict | None = None) -> tuple[float, dict]:
        want = _normalize(str(label))
        text = as_text(response)
        candidate = marked_answer(text)
        if candidate is None:
            lines = nonempty_lines(text)
            if not lines:
                return 0.0, {"reason": "empty response"}
            candidate = lines[-1]
            quoted = [a or b for a, b in _QUOTED.findall(candidate)]
            if quoted and quoted[-1].strip():
                candidate = quoted[-1]  # 'The reversed string is "olleh".'
            elif ":" in candidate and ":" not in want:
                candidate = candidate.rsplit(":", 1)[1]
        got = _normalize(strip_wrapping(strip_wrapping(candidate).rstrip(".")))
        if got == want:
            return 1.0, {"pred": got}
        details = {"pred": got[:200], "reason": "wrong string"}
        if got.lower() == want.lower():
            details["reason"] = "wrong case"
        return 0.0, details


ENV = ReverseEnv()


def _normalize(s: str) -> str:
    return re.sub(r"\s+", " ", s).strip()
