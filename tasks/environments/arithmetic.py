"""Procedural arithmetic: evaluate an integer expression; the label is the exact integer result.

Levels (digits per operand, operands, operators):

1. 1 digit, 2 operands, ``+``             (the original ``env:arithmetic``)
2. 2 digits, 2 operands, ``+``            (the original ``env:arithmetic:2``)
3. 2 digits, 2 operands, ``+ -``
4. 1 digit, 3 operands, ``+ - *``         (operator precedence matters)
5. 2 digits, 3 operands, ``+ - *``
6. 2 digits, 4 operands, ``+ - *`` with parentheses
7. 3 digits, 4 operands, ``+ - *`` with parentheses
8. 3 digits, 5 operands, ``+ - *`` with parentheses

Levels 1 and 2 draw from the seed exactly as the original generator did, so ``env:arithmetic`` and
``env:arithmetic:2`` keep producing the same prompts. The verifier takes the marked answer (\\boxed{},
'answer:') or else the last integer of the response.
"""

from __future__ import annotations

import random

from sluiceway.tasks.environments.base import as_text, check_level, final_integer, make_record

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

# level -> (digits, operands, operators, parentheses)
LEVEL_SPECS: dict[int, tuple[int, int, str, bool]] = {
    1: (1, 2, "+", False),
    2: (2, 2, "+", False),
    3: (2, 2, "+-", False),
    4: (1, 3, "+-*", False),
    5: (2, 3, "+-*", False),
    6: (2, 4, "+-*", True),
    7: (3, 4, "+-*", True),
    8: (3, 5, "+-*", True),
}

SUFFIX = "Reply with just the number."


def _bounds(digits: int) -> tuple[int, int]:
    return (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1


def _flat_value(nums: list[int], ops: list[str]) -> int:
    """Value of nums[0] ops[0] nums[1] ... with * binding tighter than + and -."""
    terms, signs, cur = [], [], nums[0]
    for op, x in zip(ops, nums[1:]):
        if op == "*":
            cur *= x
        else:
            terms.append(cur)
            signs.append(op)
            cur = x
    terms.append(cur)
    total = terms[0]
    for op, t in zip(signs, terms[1:]):
        total = total + t if op == "+" else total - t
    return total


def _tree(rng: random.Random, nums: list[int], ops: str) -> tuple[str, int]:
    """A random binary expression tree over nums (in order), rendered with parentheses round subtrees."""
    if len(nums) == 1:
        return str(nums[0]), nums[0]
    split = rng.randint(1, len(nums) - 1)
    left, lv = _tree(rng, nums[:split], ops)
    right, rv = _tree(rng, nums[split:], ops)
    op = rng.choice(ops)
    left = f"({left})" if split > 1 else left
    right = f"({right})" if len(nums) - split > 1 else right
    return f"{left} {op} {right}", OPERATORS[op](lv, rv)


class ArithmeticEnv:
    name = "arithmetic"
    levels = {
        lv: f"{d}-digit operands, {k} operands, operators {' '.join(o)}" + (", parentheses" if p else "")
        for lv, (d, k, o, p) in LEVEL_SPECS.items()
    }
    max_level = len(LEVEL_SPECS)

    def generate(self, rng: random.Random, level: int) -> dict:
        digits, k, ops, parens = LEVEL_SPECS[check_level(self, level)]
        lo, hi = _bounds(digits)
        if k == 2 and not parens:  # the original generator's draw order
            a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(ops)
            expr, value = f"{a} {op} {b}", OPERATORS[op](a, b)
        else:
            nums = [rng.randint(lo, hi) for _ in range(k)]
            if parens:
                expr, value = _tree(rng, nums, ops)
            else:
                chosen = [rng.choice(ops) for _ in range(k - 1)]
                expr = " ".join([str(nums[0])] + [f"{o} {x}" for o, x in zip(chosen, nums[1:])])
                value = _flat_value(nums, chosen)
        return make_record(self.name, level, f"What is {expr}? {SUFFIX}", value, expression=expr)

    def verify(self, response: str, label: str, metadata: dict | None = None) -> tuple[float, dict]:
        pred = final_integer(as_text(response))
        try:
            want = int(str(label).strip())
        except ValueError:
            return 0.0, {"pred": pred, "reason": f"label {label!r} is not an integer"}
        if pred is None:
            return 0.0, {"pred": None, "reason": "no integer found"}
        return float(pred == want), {"pred": pred}


ENV = ArithmeticEnv()


def generate(n: int, seed: int, digits: int = 1, operators: str = "+") -> list[dict]:
    """n records in slime's prompt format: {'input': text, 'label': answer, 'metadata': {...}}.

    The original interface (a + b with `digits`-digit operands), kept as it was.
    """
    rng = random.Random(seed)
    lo, hi = _bounds(digits)
    records = []
    for i in range(n):
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(operators)
        records.append(
            {
                "input": f"What is {a} {op} {b}? {SUFFIX}",
                "label": str(OPERATORS[op](a, b)),
                "metadata": {"env": "arithmetic", "difficulty": digits, "index": i},
            }
        )
    return records
