"""On-policy distillation's scoring stage: the teacher engine scores each trained sample's exact token ids once.

The teacher (any engine speaking SGLang's API: the embedded engine, SGLang, a router) gets prompt + response token
ids with `max_new_tokens` 0 and returns the log-prob of every input token (`input_token_logprobs`); the response
span's log-probs go into the trajectories table's `teacher_logprobs` column, one commit per step. Samples that
already have them are never sent again, so a retried or resumed stage and a replay of the table ask nothing
(tasks/train/opd.py turns them into the advantage term).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import is_trainable, read_trajectories, set_teacher_logprobs
from sluiceway.tasks.rollout.client import EngineClient


@dataclass
class TeacherScores:
    requests: int  # samples sent to the teacher by this call
    tokens: int  # response tokens scored
    stored: int  # samples whose teacher log-probs were already in the table (not sent)
    seconds: float


def to_score(rows: list[dict]) -> list[dict]:
    """The step's samples still without teacher log-probs among those that will train (finished, kept)."""
    return [r for r in rows if is_trainable(r) and r.get("teacher_logprobs") is None]


async def score_step_with_teacher(
    client: EngineClient, store: ObjectStore, run_id: str, step: int, concurrency: int = 8
) -> TeacherScores:
    """Score the step's unscored trainable samples on the teacher and store their response log-probs."""
    t0 = time.perf_counter()
    rows = [r for r in read_trajectories(store, run_id, step).to_pylist() if is_trainable(r)]
    todo = to_score(rows)
    gate = asyncio.Semaphore(concurrency)

    async def one(r: dict) -> tuple[int, int, list[float]]:
        prompt, response = list(r["prompt_token_ids"]), list(r["response_token_ids"])
        if not response:
            return r["group_id"], r["sample_index"], []
        async with gate:
            rid = f"opd-{run_id}-{step}-{r['group_id']}-{r['sample_index']}"
            lps = await client.score(prompt + response, len(prompt), rid)
        return r["group_id"], r["sample_index"], lps

    scored = list(await asyncio.gather(*(one(r) for r in todo)))
    if scored:
        set_teacher_logprobs(store, run_id, step, scored)
    sent = [lps for _, _, lps in scored if lps]
    return TeacherScores(len(sent), sum(map(len, sent)), len(rows) - len(todo), time.perf_counter() - t0)
