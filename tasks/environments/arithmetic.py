"""Procedural arithmetic: 'What is a + b?' with an exact integer answer.

A verifiable environment is a prompt generator plus a checker; here the checker is the math-answer
scorer (the label is the integer result). Difficulty is the number of digits per operand.
"""

from __future__ import annotations

import random

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def generate(n: int, seed: int, digits: int = 1, operators: str = "+") -> list[dict]:
    """n records in slime's prompt format: {'input': text, 'label': answer, 'metadata': {...}}."""
    rng = random.Random(seed)
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    records = []
    for i in range(n):
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(operators)
        records.append(
            {
                "input": f"What is {a} {op} {b}? Reply with just the number.",
                "label": str(OPERATORS[op](a, b)),
                "metadata": {"env": "arithmetic", "difficulty": digits, "index": i},
            }
        )
    return records
