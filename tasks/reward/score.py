"""The reward stage, without Prefect: score a step's unscored trajectories and store the rewards.

Only rows whose reward is still null are scored, so a re-run scores nothing twice. A scorer that raises
gives that sample reward 0 with the error recorded; the step goes on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from sluiceway.storage.trajectories import read_trajectories, set_rewards


@dataclass
class RewardResult:
    step: int
    scored: int
    already_scored: int
    errors: int


def score_step(*, store, run_id: str, step: int, scorer) -> RewardResult:
    rows = read_trajectories(store, run_id, step).to_pylist()
    # Aborted rows are unfinished partials: they are scored in the step that completes them.
    pending = [r for r in rows if r["reward"] is None and r["status"] != "aborted"]
    updates, errors = [], 0
    for r in pending:
        try:
            reward, details = scorer(r["response_text"], r["label"], r)
        except Exception as e:  # a user's scorer must not stop the run; the reason is kept with the sample
            reward, details, errors = 0.0, {"error": f"{type(e).__name__}: {e}"}, errors + 1
        updates.append((r["group_id"], r["sample_index"], float(reward), json.dumps(details, default=str)))
    if updates:
        set_rewards(store, run_id, step, updates)
    return RewardResult(step, len(updates), len(rows) - len(pending), errors)
