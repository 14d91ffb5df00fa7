"""slime's reward function, rm_hub and dynamic filter as sluiceway's scorer and group filter.

The reward stage scores rows (tasks/reward/score.py); a slime rm takes a Sample. `sample_of_row` rebuilds the Sample
the generate produced from the row (its "slime_sample" metadata: every field and a plugin's attributes, with the
tokens, loss mask and log-probs from the columns), or, for a row sluiceway's own generate made, a Sample of the
row's prompt, response, label and metadata. Then:

- `--custom-rm-path` in slime's convention: `await rm(args, sample)`, with `--group-rm` `await rm(args, samples)`;
- `--rm-type` through slime's `rm_hub.async_rm` (a slime run, or a name only slime's rm_hub has);
- a dict reward is stored whole in reward_details ("slime_reward") and `--reward-key` picks the trained number
  (a missing key: that sample's failure, reward 0 with the reason, as any scorer's failure);
- `--dynamic-sampling-filter-path` in slime's convention: `fn(args, group)` -> bool or slime's
  `DynamicFilterOutput(keep, reason)`; a dropped group's filter_reason is the reason, else the function's name.
  (`keep_when_insufficient` is not honoured: sluiceway over-samples until enough groups pass.)
"""

from __future__ import annotations

import asyncio
import inspect
import json
from argparse import Namespace
from collections.abc import Callable

from sluiceway.tasks.rollout.slime_plugins import provide_slime_names
from sluiceway.tasks.rollout.slime_plugins.generate import reward_of, slime_label
from sluiceway.tasks.rollout.slime_plugins.worker import awaited


def _details(row: dict) -> dict:
    d = row.get("reward_details")
    if isinstance(d, str):
        try:
            d = json.loads(d)
        except ValueError:
            return {}
    return d if isinstance(d, dict) else {}


def sample_of_row(row: dict):
    """The slime Sample of a trajectory row (see the module's docstring)."""
    provide_slime_names()
    from slime.utils.types import Sample

    meta = json.loads(row.get("metadata") or "{}")
    record = meta.pop("slime_sample", None)
    response_ids = list(row["response_token_ids"])
    if record is not None:
        record = dict(record, metadata=meta)
        try:
            record["status"] = Sample.Status(record.get("status"))
        except ValueError:
            pass  # a plugin's own string: kept as it is
        sample = Sample.from_dict({**record, "status": Sample.Status.PENDING})
        sample.status = record["status"]
        sample.loss_mask = list(record["loss_mask"]) if "loss_mask" in record else list(row["loss_mask"])
    else:
        sample = Sample(group_index=row["group_id"], index=row["sample_index"], prompt=row["prompt"],
                        response=row["response_text"], label=slime_label(row.get("label")), metadata=meta,
                        status=_status(Sample, row["status"]), loss_mask=list(row["loss_mask"]))  # fmt: skip
    sample.tokens = list(row["prompt_token_ids"]) + response_ids
    sample.response_length = len(response_ids)
    sample.rollout_log_probs = list(row["rollout_logprobs"]) or None
    if row.get("teacher_logprobs") is not None:
        sample.teacher_log_probs = list(row["teacher_logprobs"])
    if row.get("reward") is not None:
        sample.reward = _details(row).get("slime_reward", row["reward"])
    return sample


def _status(Sample, value: str):
    try:
        return Sample.Status(value)
    except ValueError:
        return Sample.Status.FAILED



def slime_scorer(fn: Callable, args: Namespace, group_rm: bool) -> Callable:
    """slime's rm as a scorer of tasks/reward/score.py: per sample (response, label, row), or per group."""
    if group_rm:

        async def score_group(responses, labels, rows) -> list[tuple[float, dict]]:
            rewards = await awaited(fn(args, [sample_of_row(r) for r in rows]))
            return [reward_of(x, args) for x in rewards]

        return score_group

    async def score(response, label, row) -> tuple[float, dict]:
        return reward_of(await awaited(fn(args, sample_of_row(row))), args)

    return score


def rm_hub_scorer(args: Namespace) -> Callable:
    """--rm-type through slime's rm_hub.async_rm (its dispatch: sample.metadata's rm_type first, then args.rm_type)."""
    provide_slime_names()

    async def score(response, label, row) -> tuple[float, dict]:
        from slime.rollout.rm_hub import async_rm

        return reward_of(await async_rm(args, sample_of_row(row)), args)

    return score


def slime_filter(fn: Callable, args: Namespace, name: str) -> Callable[[list[dict]], str | None]:
    """slime's dynamic sampling filter as sluiceway's group filter: None keeps the group, else the reason."""

    def check(rows: list[dict]) -> str | None:
        out = fn(args, [sample_of_row(r) for r in rows])
        if inspect.isawaitable(out):
            out = asyncio.run(out)
        keep = getattr(out, "keep", out)
        if bool(keep):
            return None
        return getattr(out, "reason", None) or name

    return check
