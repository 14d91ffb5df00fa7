"""Countdown: reach a target number from given numbers with + - * /, each number used at most once.

Levels (numbers given, their range, how many the generator's own solution uses):

1. 3 numbers in 1..10, target made from 2 of them
2. 3 numbers in 1..10, target made from all 3
3. 4 numbers in 1..20, target made from 3
4. 4 numbers in 1..25, target made from all 4
5. 5 numbers (1..10 plus one of 25/50/75/100), target made from 4
6. 6 numbers (1..10 plus two of 25/50/75/100), target made from 5 or 6, target 100..999

Every intermediate result of the generator's solution is a positive integer, so the target is reachable.
The verifier takes the marked answer (\\boxed{}, <answer>, 'answer:') or else the last line that looks
like an expression, parses it with ``ast`` (numbers, parentheses, + - * / only; no names, calls, unary
minus, powers), checks the numbers against the multiset given and the exact value (fractions allowed in
between). It never evaluates text as code.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from fractions import Fraction

from sluiceway.tasks.environments.base import as_text, check_level, make_record, marked_answer, nonempty_lines

BIG = (25, 50, 75, 100)
# level -> (count, small range max, how many big numbers, numbers used by the solution, target range)
LEVEL_SPECS: dict[int, tuple[int, int, int, tuple[int, int], tuple[int, int]]] = {
    1: (3, 10, 0, (2, 2), (1, 100)),
    2: (3, 10, 0, (3, 3), (1, 200)),
    3: (4, 20, 0, (3, 3), (1, 500)),
    4: (4, 25, 0, (4, 4), (1, 999)),
    5: (5, 10, 1, (4, 4), (10, 999)),
    6: (6, 10, 2, (5, 6), (100, 999)),
}
MAX_EXPRESSION_CHARS = 300

_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def _solution(rng: random.Random, nums: list[int], lo: int, hi: int) -> tuple[str, int] | None:
    """Combine nums (in random order) left to right into one positive-integer expression in [lo, hi]."""
    order = nums[:]
    rng.shuffle(order)
    expr, value = str(order[0]), order[0]
    for x in order[1:]:
        choices = ["+", "*"]
        if value - x > 0:
            choices.append("-")
        if value % x == 0 and x > 1:
            choices.append("/")
        if x - value > 0:
            choices.append("r-")
        op = rng.choice(choices)
        if op == "+":
            expr, value = f"{expr} + {x}", value + x
        elif op == "*":
            expr, value = f"({expr}) * {x}" if any(c in expr for c in "+-") else f"{expr} * {x}", value * x
        elif op == "-":
            expr, value = f"{expr} - {x}", value - x
        elif op == "/":
            expr, value = f"({expr}) / {x}" if " " in expr else f"{expr} / {x}", value // x
        else:
            expr, value = f"{x} - ({expr})" if " " in expr else f"{x} - {expr}", x - value
    return (expr, value) if lo <= value <= hi else None


class CountdownEnv:
    name = "countdown"
    levels = {
        1: "3 numbers in 1..10, target reachable with 2",
        2: "3 numbers in 1..10, target reachable with all 3",
        3: "4 numbers in 1..20, target reachable with 3",
        4: "4 numbers in 1..25, target reachable with all 4",
        5: "5 numbers (one of 25/50/75/100), target reachable with 4",
        6: "6 numbers (two of 25/50/75/100), target 100..999 reachable with 5-6",
    }
    max_level = len(LEVEL_SPECS)

    def generate(self, rng: random.Random, level: int) -> dict:
        count, small, n_big, (use_lo, use_hi), (lo, hi) = LEVEL_SPECS[check_level(self, level)]
        while True:
            numbers = [rng.randint(1, small) for _ in range(count - n_big)] + rng.sample(BIG, n_big)
            rng.shuffle(numbers)
            used = rng.sample(numbers, rng.randint(use_lo, use_hi))
            found = _solution(rng, used, lo, hi)
            if found is not None and found[1] not in numbers:
                break
        expr, target = found
        shown = ", ".join(map(str, numbers))
        text = (
            f"Using the numbers [{shown}], write an arithmetic expression that equals {target}. "
            "You may use + - * / and parentheses; each number may be used at most once, and you need not use "
            "all of them. Give the final expression inside \\boxed{}, e.g. \\boxed{(1 + 2) * 3}."
        )
        return make_record(self.name, level, text, target, numbers=numbers, target=target, solution=expr)

    def verify(self, response: str, label: str, metadata: dict | None = None) -> tuple[float, dict]:
        metadata = metadata or {}
        numbers = metadata.get("numbers")
        try:
            target = Fraction(int(str(label).strip()))
            numbers = Counter(int(x) for x in numbers)
        except (TypeError, ValueError):
            return 0.0, {"reason": "record has no integer target or no numbers"}
        expr = extract_expression(as_text(response), target)
        if expr is None:
            return 0.0, {"reason": "no expression found"}
        try:
            value, used = evaluate(expr)
        except ValueError as e:
            return 0.0, {"expression": expr[:200], "reason": str(e)}
        extra = Counter(used) - numbers
        if extra:
            return 0.0, {"expression": expr, "reason": f"numbers not available: {sorted(extra.elements())}"}
        if value != target:
            return 0.0, {"expression": expr, "value": str(value), "reason": "wrong value"}
        return 1.0, {"expression": expr}


ENV = CountdownEnv()

_EXPR_CHARS = re.compile(r"^[\d\s+\-*/().]+$")
_TRANSLATE = str.maketrans({"×": "*", "x": "*", "X": "*", "·": "*", "÷": "/", "−": "-", "–": "-", "\u2009": " "})


def _clean(candidate: str, target: Fraction) -> str | None:
    """The expression part of a candidate answer: LaTeX and '= target' removed; None if not an expression."""
    s = candidate.replace("\\times", "*").replace("\\cdot", "*").replace("\\div", "/").replace("\\left", "")
    s = s.replace("\\right", "").replace("$", "").replace("`", "")
    s = re.sub(r"^\*\*|\*\*$", "", s.strip())  # markdown bold round the answer
    s = s.translate(_TRANSLATE).strip().rstrip(".").strip()
    sides = [p.strip() for p in s.split("=")]
    sides = [p for p in sides if p and not (p.isdigit() and int(p) == target and len(sides) > 1)]
    if len(sides) != 1:
        return None
    s = sides[0]
    if not s or len(s) > MAX_EXPRESSION_CHARS or not _EXPR_CHARS.match(s) or not re.search(r"\d", s):
        return None
    return s


def extract_expression(text: str, target: Fraction) -> str | None:
    marked = marked_answer(text)
    if marked is not None:
        return _clean(marked, target) or _clean(nonempty_lines(marked)[0] if nonempty_lines(marked) else "", target)
    for line in reversed(nonempty_lines(text)[-5:]):
        found = _clean(line, target)
        if found is not None and re.search(r"[+\-*/]", found):
            return found
    return None


def evaluate(expr: str) -> tuple[Fraction, list[int]]:
    """Exact value of an arithmetic expression and the integer literals it uses; ValueError if not allowed."""
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"not an expression: {type(e).__name__}") from None
    used: list[int] = []

    def walk(node: ast.AST, depth: int) -> Fraction:
        if depth > 50:
            raise ValueError("expression nested too deeply")
        if isinstance(node, ast.Expression):
            return walk(node.body, depth + 1)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = walk(node.left, depth + 1), walk(node.right, depth + 1)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            if b == 0:
                raise ValueError("division by zero")
            return a / b
        raise ValueError(f"not allowed in an answer: {type(node).__name__}")

    return walk(tree, 0), used
