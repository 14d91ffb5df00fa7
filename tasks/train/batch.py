"""From a step's scored trajectories to training samples with advantages (`TrainSample`, tasks/train/samples.py).

`build_train_samples` makes them from the trajectory rows (SFT's come from tasks/train/sft_data.py); collation
(tasks/train/collation.py) turns them into micro-batches.
"""

from __future__ import annotations

import json
import math

import pyarrow as pa
import torch

from sluiceway.storage.trajectories import ABORTED, FAILED, TRUNCATED, is_trainable, is_usable
from sluiceway.tasks.train.advantages import TOKEN_LEVEL_ESTIMATORS, group_advantages, whiten_over_tokens
from sluiceway.tasks.train.samples import NonFiniteTraining, TrainSample, sample_name


def trainable_rows(table: pa.Table) -> list[dict]:
    """Finished groups that no filter dropped: the step's training batch."""
    return [r for r in table.to_pylist() if is_trainable(r)]


def build_train_samples(table: pa.Table, estimator: str, normalize_by_std: bool) -> list[TrainSample]:
    rows = trainable_rows(table)
    missing = [(r["group_id"], r["sample_index"]) for r in rows if r["reward"] is None]
    if missing:
        raise RuntimeError(f"{len(missing)} trajectories have no reward yet, e.g. (group, sample) {missing[0]}")
    bad = next((r for r in rows if not math.isfinite(r["reward"])), None)
    if bad is not None:  # the reward stage never stores one (tasks/reward/score.py); a table from before might
        raise NonFiniteTraining(
            f"train: step {bad['step']}{sample_name(bad['group_id'], bad['sample_index'])} has a non-finite "
            f"reward {bad['reward']!r}; refused before the optimizer step, so no NaN reaches the weights. "
            f"`sluiceway resume` scores such a sample again"
        )
    rewards = torch.tensor([r["reward"] for r in rows])
    groups = torch.tensor([r["group_id"] for r in rows])
    trained = torch.tensor([sum(r["loss_mask"] or []) for r in rows])  # R++-baseline whitens over these tokens
    processed = post_processed_rewards(rows)
    seq_rewards = [r["reward"] for r in rows]
    if processed is not None and estimator in TOKEN_LEVEL_ESTIMATORS:
        seq_rewards = processed  # the sequence reward the trainer's per-token estimator starts from
    if estimator in TOKEN_LEVEL_ESTIMATORS:
        adv = torch.zeros(len(rows))  # per-token advantages come from the trainer (values, reference), not here
    elif processed is not None:
        # slime's custom reward post-process: its rewards are the advantages (slime's grpo/gspo/cispo), whitened over
        # the batch's tokens for reinforce_plus_plus_baseline, as slime does.
        values = torch.tensor(processed, dtype=torch.float64)
        adv = whiten_over_tokens(values, trained) if estimator == "reinforce_plus_plus_baseline" else values
    else:
        # GSPO keeps GRPO's group-relative advantages; only its importance ratio is per sequence (the loss).
        adv = group_advantages(rewards, groups, "grpo" if estimator == "gspo" else estimator, normalize_by_std, trained)
    return [
        TrainSample(
            prompt_token_ids=r["prompt_token_ids"],
            response_token_ids=r["response_token_ids"],
            loss_mask=r["loss_mask"],
            advantage=float(a),
            rollout_logprobs=r["rollout_logprobs"],
            reward=float(reward),
            teacher_logprobs=r.get("teacher_logprobs"),
            group_id=r["group_id"],
            sample_index=r["sample_index"],
        )
        for r, a, reward in zip(rows, adv.tolist(), seq_rewards)
        if r["response_token_ids"]  # an empty response has no token to train on
    ]


def post_processed_rewards(rows: list[dict]) -> list[float] | None:
    """The rewards slime's --custom-reward-post-process-path gave the step's trained rows
    (tasks/rollout/slime_plugins/hooks.py stores them in metadata.reward_post_process), or None without one."""
    if not any('"reward_post_process"' in (r.get("metadata") or "") for r in rows):
        return None  # the common case: no row's metadata is parsed on the trainer's path
    got = [json.loads(r.get("metadata") or "{}").get("reward_post_process") for r in rows]
    missing = next((r for r, g in zip(rows, got) if g is None), None)
    if missing is not None:
        raise RuntimeError(
            f"step {missing['step']}{sample_name(missing['group_id'], missing['sample_index'])}: the reward "
            "post-process gave no reward for this trained sample while it gave others one"
        )
    return [float(g["reward"]) for g in got]


def rollout_metrics(table: pa.Table) -> dict[str, float]:
    all_rows = table.to_pylist()
    rows = trainable_rows(table)
    rewards = [r["reward"] for r in rows]
    lengths = [len(r["response_token_ids"]) for r in rows]
    by_group: dict[int, list[float]] = {}
    for r in rows:
        by_group.setdefault(r["group_id"], []).append(r["reward"])
    n = max(len(rows), 1)
    per_pool: dict[str, float] = {}
    for r in rows:  # which pools the trained samples came from (local: the run's own engines)
        key = f"rollout/pool/{r['pool']}/samples"
        per_pool[key] = per_pool.get(key, 0.0) + 1
    return per_pool | {
        "reward_mean": sum(rewards) / n,
        "response_len_mean": sum(lengths) / n,
        "truncated_frac": sum(r["status"] == TRUNCATED for r in rows) / n,
        # Groups whose samples all got the same reward carry no GRPO signal.
        "zero_std_group_frac": sum(len(set(v)) == 1 for v in by_group.values()) / max(len(by_group), 1),
        "samples": float(len(rows)),
        "samples_aborted": float(sum(r["status"] == ABORTED for r in all_rows)),
        "samples_filtered": float(sum(is_usable(r) and r.get("filter_reason") is not None for r in all_rows)),
        "samples_failed": float(sum(r["status"] == FAILED for r in all_rows)),  # never trained: reasons in metadata
    }


def max_staleness(table: pa.Table, trainer_version: int) -> int:
    """How many weight versions the oldest token of the trained samples lags the trainer (0: fully on-policy)."""
    versions = [min(r["weight_versions"] or [r["weight_version"]]) for r in trainable_rows(table)]
    return max((trainer_version - v for v in versions), default=0)
