"""Evaluation without Prefect: sample held-out prompts through the engines and score them.

A sample passes when it earns full reward (>= 1.0); pass@n is the share of prompts with at least one
passing sample among n. Seeds are fixed per (prompt, sample), so the same weights give the same numbers.
"""

from __future__ import annotations

import asyncio
import json

from sluiceway.tasks.reward.score import RewardSettings, score_rows
from sluiceway.tasks.rollout.rollout import PromptItem, RolloutSettings, sample_seed

EVAL_STEP = 999_983  # seeds for evaluation never collide with a training step's


async def evaluate(
    *,
    client,
    prompts: list[PromptItem],
    settings: RolloutSettings,
    reward_settings: RewardSettings,
    n_samples: int,
    tag: str,
    decode,
) -> dict[str, float]:
    s = settings
    sem = asyncio.Semaphore(s.max_concurrency)

    async def one(g: int, i: int) -> dict:
        p = prompts[g]
        params = {
            "max_new_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "stop_token_ids": s.stop_token_ids,
            "sampling_seed": sample_seed(s.seed, EVAL_STEP, g, i),
        }
        async with sem:
            res = await client.generate(p.token_ids, params, rid=f"eval/{tag}/{g}/{i}")
        # The shape of a trajectory row, so any scorer (per sample or per group) sees what training gives it.
        return {
            "group_id": g,
            "sample_index": i,
            "prompt_id": p.prompt_id,
            "prompt": p.text,
            "label": p.label,
            "response_text": decode(res.token_ids),
            "response_token_ids": res.token_ids,
            "metadata": json.dumps(p.metadata),
        }

    rows = await asyncio.gather(*(one(g, i) for g in range(len(prompts)) for i in range(n_samples)))
    # A scorer failure counts as a miss (reward 0), as in training.
    scored = await asyncio.to_thread(score_rows, list(rows), reward_settings)
    rewards = [reward for reward, _ in scored]
    passed = [any(r >= 1.0 for r in rewards[g * n_samples : (g + 1) * n_samples]) for g in range(len(prompts))]
    return {
        "eval/reward_mean": sum(rewards) / max(len(rewards), 1),
        f"eval/pass@{n_samples}": sum(passed) / max(len(passed), 1),
        "eval/prompts": float(len(prompts)),
    }
