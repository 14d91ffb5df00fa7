"""Group filters: which finished groups the trainer skips, and why.

A filter takes one group's rows (dicts of the trajectory schema, rewards set) and returns None to keep the
group or a short reason to drop it. A group is trained whole or not at all (GRPO's advantages are relative
to the group), so even per-sample conditions (staleness, truncation) drop the whole group.

Built-ins:
- zero_std: all rewards equal -> no GRPO signal (DAPO's dynamic sampling)
- stale: a token came from weights more than `max_staleness` versions behind the trainer (async training)
- truncated: a response hit the length limit
- overlong: a response longer than a token budget
A user filter (--dynamic-sampling-filter-path module:fn) returns True/None to keep, False or a reason to drop.
"""

from __future__ import annotations

from collections.abc import Callable

GroupFilter = Callable[[list[dict]], str | None]


def zero_std(rows: list[dict]) -> str | None:
    rewards = [r["reward"] for r in rows]
    return "zero_std" if max(rewards) - min(rewards) <= 1e-12 else None


def stale(max_staleness: int, current_version: Callable[[], int]) -> GroupFilter:
    def check(rows: list[dict]) -> str | None:
        oldest = min(v for r in rows for v in (r["weight_versions"] or [r["weight_version"]]))
        return "stale" if current_version() - oldest > max_staleness else None

    return check


def truncated(rows: list[dict]) -> str | None:
    return "truncated" if any(r["status"] == "truncated" for r in rows) else None


def overlong(max_tokens: int) -> GroupFilter:
    def check(rows: list[dict]) -> str | None:
        return "overlong" if any(len(r["response_token_ids"]) > max_tokens for r in rows) else None

    return check


BUILTIN = {"zero_std": zero_std, "truncated": truncated}


def user_filter(path: str, convention: str = "auto", slime_args: object | None = None) -> GroupFilter:
    """A built-in by name, or a function ('module:fn', 'file.py:fn' or slime's dotted 'module.fn'): sluiceway's
    `fn(rows)` returning keep (True/None) or drop (False/reason), or slime's `fn(args, group)` returning a bool or a
    DynamicFilterOutput (tasks/rollout/slime_plugins/reward.py), told apart by its signature or `convention`;
    `slime_args` is the run's slime `args` (flows/runtime.py `prepare`)."""
    from sluiceway.tasks.rollout.slime_plugins.convention import FILTER, SLIME, convention_of, load_plugin

    if path in BUILTIN:
        return BUILTIN[path]
    fn = load_plugin(path, "--dynamic-sampling-filter-path")
    name = getattr(fn, "__name__", "dynamic_filter")
    if convention_of(fn, FILTER, convention, path) == SLIME:
        from sluiceway.tasks.rollout.slime_plugins.reward import slime_filter

        if slime_args is None:
            raise ValueError("a slime-style filter needs the run's slime args")
        return slime_filter(fn, slime_args, name)

    def check(rows: list[dict]) -> str | None:
        verdict = fn(rows)
        if verdict is True or verdict is None:
            return None
        return verdict if isinstance(verdict, str) and verdict else name

    return check


def build_filters(rollout_cfg, current_version: int, slime_args: object | None = None) -> list[GroupFilter]:
    """The filter stage's filters, in the order that names a dropped group's reason."""
    r = rollout_cfg
    filters: list[GroupFilter] = []
    if r.dynamic_sampling_filter_path:
        filters.append(user_filter(r.dynamic_sampling_filter_path, r.plugin_convention, slime_args))
    if r.max_staleness is not None:
        filters.append(stale(r.max_staleness, lambda: current_version))
    if r.filter_truncated:
        filters.append(truncated)
    if r.filter_overlong_len is not None:
        filters.append(overlong(r.filter_overlong_len))
    return filters


def scoring_filter(reward_settings, filters: list[GroupFilter]) -> GroupFilter:
    """For dynamic sampling at rollout time: score the finished group (the rewards are stored with its rows,
    so the reward stage skips them) and apply `filters`."""
    from sluiceway.tasks.reward.score import score_rows

    def check(rows: list[dict]) -> str | None:
        # A reward the generator set (an agent's, a slime generate's) stands, as in slime's generate_and_rm; a
        # group rm scores the whole group, as slime's generate_and_rm_group does.
        pending = rows if reward_settings.group_rm else [r for r in rows if r["reward"] is None]
        for r, (reward, details) in zip(pending, score_rows(pending, reward_settings) if pending else []):
            r["reward"], r["reward_details"] = reward, details
        return first_reason(filters, rows)

    return check


def first_reason(filters: list[GroupFilter], rows: list[dict]) -> str | None:
    """The first filter that drops the group names the reason."""
    for f in filters:
        reason = f(rows)
        if reason:
            return reason
    return None
