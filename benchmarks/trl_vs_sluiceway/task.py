"""The benchmark's task, shared by both frameworks: single-digit addition prompts and their reward.

Pure Python on purpose: the TRL runner imports it in TRL's own virtualenv, where sluiceway is not installed.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

INSTRUCTION = "What is {a} + {b}? Give only the number."


def write_prompts(path: Path, n: int, seed: int) -> Path:
    """``n`` prompts as JSONL: {"input": text, "label": "7"}; the same file feeds both frameworks."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            f.write(json.dumps({"input": INSTRUCTION.format(a=a, b=b), "label": str(a + b)}) + "\n")
    return path


def correct(response: str, label: str) -> float:
    """1.0 when the last integer in the response is the answer ("2 + 1 = 3" counts), else 0.0."""
    found = re.findall(r"-?\d+", response)
    return float(bool(found) and found[-1] == str(label).strip())


def sluiceway_reward(response: str, label: str, sample: dict) -> float:
    """sluiceway's custom reward signature (--custom-rm-path FILE:sluiceway_reward)."""
    return correct(response, label)


def trl_reward(completions: list, label: list, **_) -> list[float]:
    """TRL's reward-function signature: conversational completions and the dataset's label column."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [correct(t, lab) for t, lab in zip(texts, label, strict=True)]
