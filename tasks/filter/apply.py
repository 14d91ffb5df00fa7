"""The filter stage, without Prefect: mark the step's groups the trainer must skip, and count them.

Dropped groups stay in the table with their reason (`filter_reason`); nothing is deleted. Re-running the
stage changes nothing and reports the same counts, because the counts are read off the table's state.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from sluiceway.storage.trajectories import group_rows, is_usable, read_trajectories, set_filter_reasons
from sluiceway.tasks.filter.filters import GroupFilter, first_reason


@dataclass
class FilterResult:
    step: int
    groups_kept: int
    groups_dropped: dict[str, int] = field(default_factory=dict)  # reason -> groups
    newly_dropped: int = 0

    def metrics(self) -> dict[str, float]:
        out = {"filter/groups_kept": float(self.groups_kept)}
        out |= {f"filter/dropped_{reason}": float(n) for reason, n in sorted(self.groups_dropped.items())}
        return out


def filter_step(*, store, run_id: str, step: int, filters: list[GroupFilter]) -> FilterResult:
    rows = [r for r in read_trajectories(store, run_id, step).to_pylist() if is_usable(r)]
    groups = group_rows(rows)
    updates = []
    for members in groups.values():
        if members[0]["filter_reason"] is not None or any(r["reward"] is None for r in members):
            continue  # already decided (e.g. surplus, or dropped by an earlier run of this stage)
        reason = first_reason(filters, members)
        if reason:
            updates += [(r["group_id"], r["sample_index"], reason) for r in members]
            for r in members:
                r["filter_reason"] = reason
    if updates:
        set_filter_reasons(store, run_id, step, updates)
    reasons = Counter(members[0]["filter_reason"] for members in groups.values())
    kept = reasons.pop(None, 0)
    return FilterResult(step, kept, dict(reasons), newly_dropped=len({g for g, _, _ in updates}))
