"""Evaluation without Prefect: sample held-out prompts with the current weights and score them.

A sample passes when it earns full reward (>= 1.0); pass@n is the share of prompts with at least one
passing sample among n. Seeds are fixed per (prompt, sample), so the same weights give the same numbers.
"""

from __future__ import annotations

from sluiceway.tasks.rollout.rollout import PromptItem, sample_seed
from sluiceway.tasks.rollout.sampler import Sampler, SamplingParams

EVAL_STEP = -1  # seeds for evaluation never collide with a training step's


def evaluate(
    *,
    prompts: list[PromptItem],
    sampler: Sampler,
    params: SamplingParams,
    scorer,
    n_samples: int,
    seed: int,
    micro_batch_size: int,
    decode,
) -> dict[str, float]:
    flat = [p for p in prompts for _ in range(n_samples)]
    seeds = [sample_seed(seed, EVAL_STEP, g, i) for g in range(len(prompts)) for i in range(n_samples)]
    completions = sampler.generate([p.token_ids for p in flat], params, seeds, micro_batch_size)
    rewards = []
    for p, c in zip(flat, completions):
        try:
            reward, _ = scorer(decode(c.token_ids), p.label, {"prompt": p.text, "metadata": p.metadata})
        except Exception:  # a scorer failure counts as a miss, as in training
            reward = 0.0
        rewards.append(float(reward))
    passed = [any(r >= 1.0 for r in rewards[g * n_samples : (g + 1) * n_samples]) for g in range(len(prompts))]
    return {
        "eval/reward_mean": sum(rewards) / max(len(rewards), 1),
        f"eval/pass@{n_samples}": sum(passed) / max(len(passed), 1),
        "eval/prompts": float(len(prompts)),
    }
