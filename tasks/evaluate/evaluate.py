"""Evaluation without Prefect: sample held-out prompts through the engines and score them.

A sample passes when it earns full reward (>= 1.0). pass@k, for k = 1, 2, 4, ... up to the n samples per
prompt, is the unbiased estimate 1 - C(n-c, k) / C(n, k) averaged over prompts (c = passing samples; Chen et
al. 2021). Seeds are fixed per (prompt, sample), so the same weights give the same numbers; temperature 0 is
greedy (the argmax) in the embedded engine and in SGLang alike. Given a store, every sample goes to the evals
table (storage/evals.py) with its reward and the sampling settings it was drawn with.
"""

from __future__ import annotations

import asyncio
import json
import math

from sluiceway.storage.evals import append_eval_samples
from sluiceway.storage.object_store import ObjectStore
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
    name: str = "eval",
    store: ObjectStore | None = None,
    run_id: str = "",
    step: int = 0,
) -> dict[str, float]:
    """Metrics of one eval set; with ``store``, its samples are stored under (``run_id``, ``step``) too."""
    s = settings
    sem = asyncio.Semaphore(s.max_concurrency)

    async def one(g: int, i: int) -> dict:
        p = prompts[g]
        seed = sample_seed(s.seed, EVAL_STEP, g, i)
        params = {
            "max_new_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "stop_token_ids": s.stop_token_ids,
            "sampling_seed": seed,
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
            "prompt_token_ids": p.token_ids,
            "finish_reason": res.finish_reason,
            "weight_version": res.weight_version,
            "sampling_seed": seed,
            "latency_s": res.latency_s,
        }

    rows = await asyncio.gather(*(one(g, i) for g in range(len(prompts)) for i in range(n_samples)))
    # A scorer failure counts as a miss (reward 0), as in training.
    scored = await asyncio.to_thread(score_rows, list(rows), reward_settings)
    rewards = [reward for reward, _ in scored]
    if store is not None:
        samples = [eval_sample(r, reward, details, run_id, step, name, s) for r, (reward, details) in zip(rows, scored)]
        await asyncio.to_thread(append_eval_samples, store, samples)
    passes = [sum(r >= 1.0 for r in rewards[g * n_samples : (g + 1) * n_samples]) for g in range(len(prompts))]
    out = {f"eval/{name}/reward_mean": sum(rewards) / max(len(rewards), 1)}
    k = 1
    while k <= n_samples:
        out[f"eval/{name}/pass@{k}"] = sum(pass_at_k(n_samples, c, k) for c in passes) / max(len(passes), 1)
        k *= 2
    out[f"eval/{name}/prompts"] = float(len(prompts))
    return out


def eval_sample(row: dict, reward: float, details: dict, run_id: str, step: int, name: str, s: RolloutSettings) -> dict:
    """A scored row as a row of the evals table."""
    out = {k: v for k, v in row.items() if k != "group_id"}
    return out | {
        "run_id": run_id, "step": step, "eval_set": name, "prompt_index": row["group_id"], "reward": reward,
        "reward_details": details, "temperature": s.temperature, "top_p": s.top_p, "max_new_tokens": s.max_new_tokens,
    }  # fmt: skip


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)
