"""The rollout stage, without Prefect: generate a step's groups and append them to the trajectory table.

Groups go to the table as soon as a micro-batch of them finishes, so a crash loses at most the groups in
flight, and a re-run generates only the groups the table does not hold yet.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from sluiceway.storage.trajectories import append_trajectories, existing_group_ids
from sluiceway.tasks.rollout.sampler import Sampler, SamplingParams


@dataclass
class PromptItem:
    prompt_id: str
    text: str  # rendered prompt (chat template applied when asked)
    token_ids: list[int]
    label: str | None
    metadata: dict


def prompt_indices_for_step(n_prompts: int, step: int, batch_size: int, seed: int) -> list[int]:
    """Epoch-wise shuffled order: step k takes the next `batch_size` prompts, reshuffling each epoch."""
    out = []
    pos = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(pos, n_prompts)
        order = list(range(n_prompts))
        random.Random(seed * 7919 + epoch).shuffle(order)
        take = min(batch_size - len(out), n_prompts - offset)
        out.extend(order[offset : offset + take])
        pos += take
    return out


def sample_seed(seed: int, step: int, group_id: int, sample_index: int) -> int:
    return (seed * 1_000_003 + step * 10_007 + group_id * 101 + sample_index) % (2**63)


@dataclass
class RolloutResult:
    step: int
    groups_generated: int
    groups_skipped: int
    samples_written: int
    gen_time_s: float


def run_rollout(
    *,
    store,
    run_id: str,
    step: int,
    prompts: list[PromptItem],
    sampler: Sampler,
    params: SamplingParams,
    n_samples: int,
    seed: int,
    micro_batch_size: int,
    decode,
    engine: str = "embedded",
    pool: str = "local",
) -> RolloutResult:
    done = existing_group_ids(store, run_id, step)
    todo = [g for g in range(len(prompts)) if g not in done]
    groups_per_batch = max(1, micro_batch_size // n_samples)
    written, t0 = 0, time.perf_counter()
    for start in range(0, len(todo), groups_per_batch):
        group_ids = todo[start : start + groups_per_batch]
        flat = [prompts[g].token_ids for g in group_ids for _ in range(n_samples)]
        # Seeds depend on (step, group, sample), not on batch layout: a resumed step samples like the original.
        seeds = [sample_seed(seed, step, g, i) for g in group_ids for i in range(n_samples)]
        completions = sampler.generate(flat, params, seeds=seeds, micro_batch_size=len(flat))
        rows = []
        now = datetime.now(UTC)
        for k, c in enumerate(completions):
            g, i = group_ids[k // n_samples], k % n_samples
            p = prompts[g]
            rows.append(
                {
                    "run_id": run_id,
                    "step": step,
                    "group_id": g,
                    "sample_index": i,
                    "prompt_id": p.prompt_id,
                    "prompt": p.text,
                    "label": p.label,
                    "prompt_token_ids": p.token_ids,
                    "response_token_ids": c.token_ids,
                    "response_text": decode(c.token_ids),
                    "rollout_logprobs": c.logprobs,
                    "loss_mask": [1] * len(c.token_ids),
                    "reward": None,
                    "reward_details": None,
                    "status": "completed" if c.finish_reason == "stop" else "truncated",
                    "finish_reason": c.finish_reason,
                    "weight_version": c.weight_version,
                    "weight_versions": [c.weight_version],
                    "engine": engine,
                    "pool": pool,
                    "gen_time_s": c.gen_time_s,
                    "created_at": now,
                    "metadata": json.dumps(p.metadata),
                }
            )
        app_id = f"rollout/{run_id}/{step}/" + ",".join(map(str, group_ids))
        if append_trajectories(store, rows, app_id=app_id):
            written += len(rows)
    return RolloutResult(step, len(todo), len(done), written, time.perf_counter() - t0)
