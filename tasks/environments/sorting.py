"""Sorting: sort a list of integers or words; the label is the sorted list joined by ', '.

Levels:

1. 4 integers in 0..20, ascending
2. 6 integers in 0..99, ascending
3. 6 integers in 0..99, descending
4. 5 words, alphabetical
5. 8 integers in -99..99 (repeats possible), ascending or descending
6. 8 words, alphabetical or reverse alphabetical
7. 12 integers in -999..999 (repeats possible), ascending or descending

The verifier reads the marked answer (\\boxed{}, <answer>, 'answer:'), else the last [...] list, else the
last line (after its last colon), pulls the integers / words out of it and needs exactly the sorted list:
same items, same count, same order. Words compare case-insensitively; a joining 'and' is ignored.
"""

from __future__ import annotations

import random
import re

from sluiceway.tasks.environments.base import as_text, check_level, make_record, marked_answer, nonempty_lines
from sluiceway.tasks.environments.words import WORDS

# level -> (kind, count, low, high, orders to choose from)
LEVEL_SPECS: dict[int, tuple[str, int, int, int, tuple[str, ...]]] = {
    1: ("int", 4, 0, 20, ("ascending",)),
    2: ("int", 6, 0, 99, ("ascending",)),
    3: ("int", 6, 0, 99, ("descending",)),
    4: ("word", 5, 0, 0, ("ascending",)),
    5: ("int", 8, -99, 99, ("ascending", "descending")),
    6: ("word", 8, 0, 0, ("ascending", "descending")),
    7: ("int", 12, -999, 999, ("ascending", "descending")),
}
_INT = re.compile(r"-?[0-9]+")
_WORD = re.compile(r"[^\W\d_]+")


class SortingEnv:
    name = "sorting"
    levels = {
        lv: f"{n} {'integers in ' + str(lo) + '..' + str(hi) if kind == 'int' else 'words'}, {' or '.join(orders)}"
        for lv, (kind, n, lo, hi, orders) in LEVEL_SPECS.items()
    }
    max_level = len(LEVEL_SPECS)

    def generate(self, rng: random.Random, level: int) -> dict:
        kind, n, lo, hi, orders = LEVEL_SPECS[check_level(self, level)]
        order = rng.choice(orders)
        descending = order == "descending"
        if kind == "int":
            distinct = level <= 3
            items = rng.sample(range(lo, hi + 1), n) if distinct else [rng.randint(lo, hi) for _ in range(n)]
            shown = ", ".join(map(str, items))
            how = "from largest to smallest" if descending else "from smallest to largest"
            text = f"Sort these numbers {how}: {shown}."
        else:
            items = rng.sample(WORDS, n)
            shown = ", ".join(items)
            how = "in reverse alphabetical order (z to a)" if descending else "in alphabetical order (a to z)"
            text = f"Sort these words {how}: {shown}."
        text += " Reply with the sorted list only, comma-separated."
        answer = sorted(items, reverse=descending)
        return make_record(
            self.name, level, text, ", ".join(map(str, answer)), kind=kind, order=order, items=list(items)
        )

    def verify(self, response: str, label: str, metadata: dict | None = None) -> tuple[float, dict]:
        metadata = metadata or {}
        label = str(label)
        kind = metadata.get("kind") or ("int" if _INT.fullmatch(label.split(",")[0].strip() or "x") else "word")
        want = parse_items(label, kind)
        candidate = extract_list(as_text(response))
        if candidate is None:
            return 0.0, {"reason": "no list found"}
        got = parse_items(candidate, kind)
        if kind == "word" and "and" not in want:
            got = [w for w in got if w != "and"]
        if got == want:
            return 1.0, {"pred": got}
        reason = "wrong length" if len(got) != len(want) else "wrong order or items"
        return 0.0, {"pred": got[:50], "reason": reason}


ENV = SortingEnv()


def parse_items(text: str, kind: str) -> list:
    if kind == "int":
        return [int(x) for x in _INT.findall(text.replace("\u2212", "-")) if len(x) <= 30]
    return [w.lower() for w in _WORD.findall(text)]


def extract_list(text: str) -> str | None:
    marked = marked_answer(text)
    if marked is not None:
        return marked
    end = text.rfind("]")
    start = text.rfind("[", 0, end) if end >= 0 else -1
    if start >= 0:
        return text[start + 1 : end]
    lines = nonempty_lines(text)
    if not lines:
        return None
    return lines[-1].rsplit(":", 1)[-1]
