"""Counting: how many times a letter occurs in a text, or a word in a list; the label is the count.

Levels:

1. a letter in one word
2. a letter in 12-20 random lowercase letters
3. a letter in a phrase of 5-8 words, case-insensitive
4. a word in a list of 10-15 words drawn from 4 distinct words
5. a word in a list of 25-40 words drawn from 6 distinct words, in mixed case (case-insensitive)
6. a letter in 40-60 random letters (mixed case) and digits, case-insensitive

The verifier reads the marked answer (\\boxed{}, <answer>, 'answer:'), else the last integer in the response.
"""

from __future__ import annotations

import random
import string

from sluiceway.tasks.environments.base import as_text, check_level, final_integer, make_record
from sluiceway.tasks.environments.words import WORDS

SUFFIX = "Reply with just the number."


def _letter(rng: random.Random, text: str) -> str:
    """Usually a letter of the text, sometimes any letter (the answer may be 0)."""
    letters = [c.lower() for c in text if c.isalpha()]
    return rng.choice(letters) if letters and rng.random() < 0.8 else rng.choice(string.ascii_lowercase)


def _mixed_case(rng: random.Random, w: str) -> str:
    return rng.choice([w, w.upper(), w.capitalize()])


class CountingEnv:
    name = "counting"
    levels = {
        1: "a letter in one word",
        2: "a letter in 12-20 random lowercase letters",
        3: "a letter in a 5-8 word phrase (case-insensitive)",
        4: "a word in a list of 10-15 words from 4 distinct words",
        5: "a word in a list of 25-40 mixed-case words from 6 distinct words",
        6: "a letter in 40-60 random mixed-case letters and digits (case-insensitive)",
    }
    max_level = len(levels)

    def generate(self, rng: random.Random, level: int) -> dict:
        check_level(self, level)
        if level in (4, 5):
            pool = rng.sample(WORDS, 4 if level == 4 else 6)
            items = [rng.choice(pool) for _ in range(rng.randint(10, 15) if level == 4 else rng.randint(25, 40))]
            if level == 5:
                items = [_mixed_case(rng, w) for w in items]
            target = rng.choice(pool)
            count = sum(w.lower() == target for w in items)
            case = " (ignoring case)" if level == 5 else ""
            text = f'How many times does the word "{target}" appear in this list{case}: {", ".join(items)}? {SUFFIX}'
            return make_record(self.name, level, text, count, unit="word", target=target, subject=", ".join(items))
        if level == 1:
            subject = rng.choice(WORDS)
        elif level == 2:
            subject = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(12, 20)))
        elif level == 3:
            subject = " ".join(_mixed_case(rng, w) for w in rng.sample(WORDS, rng.randint(5, 8)))
        else:
            alphabet = string.ascii_letters + string.digits
            subject = "".join(rng.choice(alphabet) for _ in range(rng.randint(40, 60)))
        letter = _letter(rng, subject)
        count = subject.lower().count(letter)
        case = " (upper or lower case)" if level >= 3 else ""
        text = f'How many times does the letter "{letter}" appear{case} in "{subject}"? {SUFFIX}'
        return make_record(self.name, level, text, count, unit="letter", target=letter, subject=subject)

    def verify(self, response: str, label: str, metadata: dict | None = None) -> tuple[float, dict]:
        try:
            want = int(str(label).strip())
        except ValueError:
            return 0.0, {"reason": f"label {label!r} is not an integer"}
        pred = final_integer(as_text(response))
        if pred is None:
            return 0.0, {"pred": None, "reason": "no integer found"}
        return float(pred == want), {"pred": pred}


ENV = CountingEnv()
