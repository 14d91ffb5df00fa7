"""Token-level F1 between the answer and the label (SQuAD normalisation); a list label takes the best."""

from __future__ import annotations

import re
import string
from collections import Counter

from sluiceway.tasks.reward.verifiers.extract import structured_answer
from sluiceway.tasks.reward.verifiers.text import clip, normalize, prepare

MAX_TOKENS = 2_000  # bounds the Counter work on a long unmarked response
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def squad_tokens(s: str) -> list[str]:
    """Lower case, punctuation and articles dropped, whitespace split (SQuAD v1.1 evaluation)."""
    return _ARTICLES.sub(" ", normalize(s).lower().translate(_PUNCT)).split()


def token_f1(pred: str, gold: str) -> float:
    p, g = squad_tokens(pred)[:MAX_TOKENS], squad_tokens(gold)
    if not p or not g:
        return float(p == g)
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def f1_verify(response: object, label: object) -> tuple[float, dict]:
    text = prepare(response)
    found, method = structured_answer(text)
    pred = (found if found is not None else text).strip()
    details: dict = {"pred": clip(pred), "method": method if found is not None else "whole"}
    golds = [str(x) for x in label] if isinstance(label, list | tuple) else ["" if label is None else str(label)]
    if not squad_tokens(pred):
        return 0.0, {**details, "reason": "empty answer"}
    if not any(squad_tokens(g) for g in golds):
        return 0.0, {**details, "reason": "empty label"}
    score = max(token_f1(pred, g) for g in golds)
    return score, details if score > 0 else {**details, "reason": "no overlapping tokens"}
