"""Logic puzzles with a unique answer, checked by brute force when generated.

Levels:

1. knights and knaves, 2 people (knights always tell the truth, knaves always lie)
2. finishing order of a race, 3 runners
3. knights and knaves, 3 people
4. finishing order of a race, 4 runners
5. knights and knaves, 4 people

Knights and knaves: everyone makes one statement; the generator draws statements until exactly one
knight/knave assignment of the 2^n is consistent. Ordering: clues true of a hidden order are added until
exactly one of the n! orders satisfies them all, then clues that are not needed are dropped. The label is
'Alice: knight, Bruno: knave' or 'Alice, Bruno, Clara' (first to last).

The verifier reads the marked answer (\\boxed{}, <answer>, 'answer:'), else the last line, else the last
n lines. Knights and knaves: each name must get exactly one role (knight / knave; truth-teller / liar),
the role following the name ('Alice and Bruno are knights' gives both). Ordering: the order in which
the names first appear.
"""

from __future__ import annotations

import itertools
import random
import re

from sluiceway.tasks.environments.base import as_text, check_level, make_record, marked_answer, nonempty_lines
from sluiceway.tasks.environments.words import NAMES

# level -> (kind, people)
LEVEL_SPECS: dict[int, tuple[str, int]] = {
    1: ("knights", 2),
    2: ("order", 3),
    3: ("knights", 3),
    4: ("order", 4),
    5: ("knights", 4),
}
ORDINALS = ["first", "second", "third", "fourth", "fifth"]
_ROLE = re.compile(r"\b(knights?|knaves?|truth[- ]?tellers?|liars?)\b", re.IGNORECASE)


# ---- knights and knaves -------------------------------------------------------------------------------


def _kk_true(stmt: tuple, a: tuple[bool, ...]) -> bool:
    kind = stmt[0]
    if kind == "is":
        return a[stmt[1]] == stmt[2]
    if kind == "both":
        return a[stmt[1]] and a[stmt[2]]
    if kind == "some_knave":
        return not (a[stmt[1]] and a[stmt[2]])
    if kind == "same":
        return a[stmt[1]] == a[stmt[2]]
    if kind == "diff":
        return a[stmt[1]] != a[stmt[2]]
    if kind == "count":
        return sum(a) == stmt[1]
    raise ValueError(kind)


def kk_solutions(statements: list[tuple], n: int) -> list[tuple[bool, ...]]:
    """Every assignment (True = knight) under which each speaker's statement is true iff they are a knight."""
    return [
        a
        for a in itertools.product((True, False), repeat=n)
        if all(_kk_true(s, a) == a[i] for i, s in enumerate(statements))
    ]


def _kk_statement(rng: random.Random, speaker: int, n: int) -> tuple:
    others = [i for i in range(n) if i != speaker]
    kind = rng.choice(["is", "is", "both", "some_knave", "same", "diff"] + (["count"] if n >= 3 else []))
    if kind == "is":
        return ("is", rng.choice(others), rng.random() < 0.5)
    if kind == "count":
        return ("count", rng.randint(0, n))
    x, y = rng.sample(range(n), 2)
    return (kind, x, y)


def _kk_render(stmt: tuple, speaker: int, names: list[str]) -> str:
    def who(i: int) -> str:
        return "I" if i == speaker else names[i]

    kind = stmt[0]
    if kind == "is":
        return f"{who(stmt[1])} is a {'knight' if stmt[2] else 'knave'}."
    if kind == "count":
        k = stmt[1]
        return f"Exactly {k} of us {'is a knight' if k == 1 else 'are knights'}."
    x, y = sorted(stmt[1:], key=lambda i: i == speaker)  # "Bruno and I", not "I and Bruno"
    pair = f"{who(x)} and {who(y)}"
    return {
        "both": f"{pair} are both knights.",
        "some_knave": f"At least one of {pair if y != speaker else names[x] + ' and me'} is a knave.",
        "same": f"{pair} are the same kind.",
        "diff": f"{pair} are different kinds.",
    }[kind]


def _knights(rng: random.Random, level: int, n: int) -> dict:
    names = rng.sample(NAMES, n)
    while True:
        statements = [_kk_statement(rng, i, n) for i in range(n)]
        sols = kk_solutions(statements, n)
        if len(sols) == 1:
            break
    roles = ["knight" if k else "knave" for k in sols[0]]
    said = " ".join(f'{names[i]} says: "{_kk_render(s, i, names)}"' for i, s in enumerate(statements))
    text = (
        f"On an island, knights always tell the truth and knaves always lie. You meet {n} inhabitants: "
        f"{', '.join(names[:-1])} and {names[-1]}. {said} Who is a knight and who is a knave? "
        f"Give your final answer on the last line in the form "
        f"'{', '.join(f'{m}: knight/knave' for m in names)}'."
    )
    label = ", ".join(f"{m}: {r}" for m, r in zip(names, roles))
    return make_record(
        "logic", level, text, label, kind="knights", names=names, statements=[list(s) for s in statements]
    )


# ---- ordering -----------------------------------------------------------------------------------------


def _order_true(clue: tuple, pos: dict[int, int]) -> bool:
    kind = clue[0]
    if kind == "before":
        return pos[clue[1]] < pos[clue[2]]
    if kind == "right_before":
        return pos[clue[1]] + 1 == pos[clue[2]]
    if kind == "at":
        return pos[clue[1]] == clue[2]
    if kind == "not_at":
        return pos[clue[1]] != clue[2]
    if kind == "apart":
        return abs(pos[clue[1]] - pos[clue[2]]) > 1
    raise ValueError(kind)


def order_solutions(clues: list[tuple], n: int) -> list[tuple[int, ...]]:
    """Every order (a tuple of people, first to last) consistent with all clues."""
    out = []
    for perm in itertools.permutations(range(n)):
        pos = {p: i for i, p in enumerate(perm)}
        if all(_order_true(c, pos) for c in clues):
            out.append(perm)
    return out


def _order_clue(rng: random.Random, order: list[int]) -> tuple:
    n = len(order)
    pos = {p: i for i, p in enumerate(order)}
    kind = rng.choice(["before", "before", "right_before", "not_at", "not_at", "apart", "at"])
    if kind == "at":
        x = rng.randrange(n)
        return ("at", x, pos[x])
    if kind == "not_at":
        x = rng.randrange(n)
        return ("not_at", x, rng.choice([k for k in range(n) if k != pos[x]]))
    x, y = rng.sample(range(n), 2)
    if pos[x] > pos[y]:
        x, y = y, x
    if kind == "right_before" and pos[y] != pos[x] + 1:
        kind = "before"
    if kind == "apart" and pos[y] == pos[x] + 1:
        kind = "right_before"
    return (kind, x, y)


def _ordinal(k: int, n: int) -> str:
    return "last" if k == n - 1 else ORDINALS[k]


def _order_render(clue: tuple, names: list[str], n: int) -> str:
    kind, x = clue[0], names[clue[1]]
    if kind == "before":
        return f"{x} finished ahead of {names[clue[2]]}."
    if kind == "right_before":
        return f"{x} finished immediately ahead of {names[clue[2]]}."
    if kind == "at":
        return f"{x} finished {_ordinal(clue[2], n)}."
    if kind == "not_at":
        return f"{x} did not finish {_ordinal(clue[2], n)}."
    return f"{x} and {names[clue[2]]} did not finish next to each other."


def _order(rng: random.Random, level: int, n: int) -> dict:
    names = rng.sample(NAMES, n)
    order = list(range(n))
    rng.shuffle(order)
    clues: list[tuple] = []
    while len(order_solutions(clues, n)) > 1:
        clue = _order_clue(rng, order)
        if clue not in clues:
            clues.append(clue)
    for clue in rng.sample(clues, len(clues)):  # drop clues that are not needed
        rest = [c for c in clues if c != clue]
        if len(order_solutions(rest, n)) == 1:
            clues = rest
    rng.shuffle(clues)
    text = (
        f"{', '.join(names[:-1])} and {names[-1]} ran a race; there were no ties. "
        + " ".join(_order_render(c, names, n) for c in clues)
        + " In what order did they finish? Give your final answer on the last line as the names from first "
        "to last, separated by commas."
    )
    label = ", ".join(names[i] for i in order)
    return make_record("logic", level, text, label, kind="order", names=names, clues=[list(c) for c in clues])


# ---- the environment ----------------------------------------------------------------------------------


class LogicEnv:
    name = "logic"
    levels = {
        lv: f"{'knights and knaves' if k == 'knights' else 'race order'}, {n} people"
        for lv, (k, n) in LEVEL_SPECS.items()
    }
    max_level = len(LEVEL_SPECS)

    def generate(self, rng: random.Random, level: int) -> dict:
        kind, n = LEVEL_SPECS[check_level(self, level)]
        return _knights(rng, level, n) if kind == "knights" else _order(rng, level, n)

    def verify(self, response: str, label: str, metadata: dict | None = None) -> tuple[float, dict]:
        metadata = metadata or {}
        label = str(label)
        kind = metadata.get("kind") or ("knights" if _ROLE.search(label) else "order")
        names = metadata.get("names")
        if not isinstance(names, list) or not all(isinstance(m, str) for m in names):
            names = [part.split(":")[0].strip() for part in label.split(",")]
        text = as_text(response)
        region = _region(text, names)
        if region is None:
            return 0.0, {"reason": "no answer found"}
        if kind == "knights":
            want = parse_roles(label, names)
            got = parse_roles(region, names)
            if isinstance(got, str):
                return 0.0, {"reason": got}
            return float(got == want), {"pred": got}
        got_order = parse_order(region, names)
        if got_order is None:
            return 0.0, {"reason": "not every name is in the answer"}
        return float(", ".join(got_order) == ", ".join(label.split(", "))), {"pred": got_order}


ENV = LogicEnv()


def _name_pattern(names: list[str]) -> re.Pattern:
    return re.compile(r"\b(" + "|".join(re.escape(m) for m in names) + r")\b", re.IGNORECASE)


def _region(text: str, names: list[str]) -> str | None:
    marked = marked_answer(text)
    if marked is not None:
        return marked
    lines = nonempty_lines(text)
    if not lines:
        return None
    found = {m.group(1).lower() for m in _name_pattern(names).finditer(lines[-1])}
    if len(found) == len(names):
        return lines[-1]
    return "\n".join(lines[-len(names) :])


def parse_roles(region: str, names: list[str]) -> dict[str, str] | str:
    """{name: role} from text like 'Alice: knight, Bruno and Clara are knaves'; a reason string if unclear."""
    canon = {m.lower(): m for m in names}
    hits = list(_name_pattern(names).finditer(region))
    roles: dict[str, set[str]] = {}
    pending: list[str] = []
    for k, m in enumerate(hits):
        end = hits[k + 1].start() if k + 1 < len(hits) else len(region)
        found = {
            "knight" if w.lower().startswith(("knight", "truth")) else "knave"
            for w in _ROLE.findall(region[m.end() : end])
        }
        pending.append(canon[m.group(1).lower()])
        if found:
            for name in pending:
                roles.setdefault(name, set()).update(found)
            pending = []
    missing = [m for m in names if m not in roles]
    if missing:
        return f"no role for {', '.join(missing)}"
    unclear = [m for m in names if len(roles[m]) > 1]
    if unclear:
        return f"both roles given for {', '.join(unclear)}"
    return {m: next(iter(roles[m])) for m in names}


def parse_order(region: str, names: list[str]) -> list[str] | None:
    canon = {m.lower(): m for m in names}
    first: dict[str, int] = {}
    for m in _name_pattern(names).finditer(region):
        first.setdefault(canon[m.group(1).lower()], m.start())
    if len(first) != len(names):
        return None
    return sorted(first, key=first.get)
