"""The reward stage, without Prefect: score a step's unscored trajectories and store the rewards.

Only rows whose reward is still null are scored, so a re-run scores nothing twice. A scorer that raises,
runs past its time limit or returns a non-finite number (NaN, inf: from any scorer, built-in, custom, group
or remote) gives that sample reward 0, with `reward_status` ("error" or "timeout") and a message in
`reward_details`; the step goes on. A non-finite reward never reaches a table: it would make every later loss
NaN. A step where every sample fails stops the run instead (an unusable reward source must not be trained on
as zeros).

Scorers (see scorer_registry.py) take one sample: (response, label, sample) -> float | (float, details) | dict.
With --group-rm the user's function takes a whole group: (responses, labels, samples) -> list of the same.
Either kind may be an async function.
With --reward-key a dict result's value under that key is the reward and the rest goes to the details.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from sluiceway.infra.errors import Fault
from sluiceway.storage.trajectories import (
    is_usable,
    read_trajectories,
    reward_problem,
    set_rewards,
    trainable_reward,
)
from sluiceway.tasks.reward.verifiers.shaping import length_penalty


@dataclass
class RewardSettings:
    scorer: Callable  # per sample, or per group with group_rm
    timeout_s: float = 30.0
    group_rm: bool = False
    reward_key: str | None = None
    length_budget: int | None = None  # shaping: full reward up to this many response tokens...
    length_window: int = 256  # ...then linearly down to 0 at budget + window
    # The threads the scorer runs on, made at the first score. A scorer thread that times out cannot be killed
    # (Python threads): it finishes in the background while the step goes on. Code execution runs in a sandboxed
    # process with its own limits for that reason.
    _threads: cf.ThreadPoolExecutor | None = field(default=None, init=False, repr=False, compare=False)

    def threads(self) -> cf.ThreadPoolExecutor:
        if self._threads is None:
            self._threads = cf.ThreadPoolExecutor(max_workers=8, thread_name_prefix="sluiceway-reward")
        return self._threads


def as_reward(out, reward_key: str | None) -> tuple[float, dict]:
    if isinstance(out, dict):
        if reward_key is None:
            raise ValueError(f"scorer returned a dict ({sorted(out)}) but --reward-key is not set")
        if reward_key not in out:
            raise ValueError(f"scorer result has no key {reward_key!r} (keys: {sorted(out)})")
        return float(out[reward_key]), {k: v for k, v in out.items() if k != reward_key}
    if isinstance(out, tuple):
        reward, details = out
        return float(reward), dict(details or {})
    return float(out), {}


def checked_reward(out, reward_key: str | None) -> tuple[float, dict]:
    """`as_reward`, or the sample's failure when the reward is not a number training can hold: NaN, inf, or one
    finite in float64 but not in float32 (1e308), in a table would be trained on (every loss of the step NaN)."""
    reward, details = as_reward(out, reward_key)
    problem = reward_problem(reward)
    if problem is not None:
        return _failed("error", f"the scorer returned a {problem}")
    return reward, details


def _call(fn: Callable, *args):
    """Run a scorer in this worker thread; an async scorer gets its own event loop here."""
    out = fn(*args)
    return asyncio.run(out) if inspect.isawaitable(out) else out


def _failed(status: str, message: str) -> tuple[float, dict]:
    return 0.0, {"reward_status": status, "message": message[:2000]}


def score_rows(rows: list[dict], s: RewardSettings) -> list[tuple[float, dict]]:
    """(reward, details) for each row; failures and timeouts become reward 0 with their reason."""
    out = _score(rows, s)
    if s.length_budget is None:
        return out
    shaped = []
    for r, (reward, details) in zip(rows, out):
        n = len(r.get("response_token_ids") or [])  # the engine's tokens: length is never re-tokenized text
        penalty = length_penalty(n, s.length_budget, s.length_window)
        details = {**details, "length": n, "length_penalty": penalty, "unpenalized_reward": reward}
        shaped.append((reward * (1.0 - penalty), details))
    return shaped


def _score(rows: list[dict], s: RewardSettings) -> list[tuple[float, dict]]:
    if s.group_rm:
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(r["group_id"], []).append(i)
        out: list[tuple[float, dict]] = [(0.0, {})] * len(rows)
        for idx in groups.values():
            members = [rows[i] for i in idx]
            fut = s.threads().submit(
                _call, s.scorer, [m["response_text"] for m in members], [m["label"] for m in members], members
            )
            try:
                results = fut.result(timeout=s.timeout_s)
                if len(results) != len(idx):
                    raise ValueError(f"group scorer returned {len(results)} rewards for {len(idx)} samples")
                scored = [checked_reward(x, s.reward_key) for x in results]
            except cf.TimeoutError:
                scored = [_failed("timeout", f"group scorer took longer than {s.timeout_s}s")] * len(idx)
            except Exception as e:  # a user's scorer must not stop the run
                scored = [_failed("error", f"{type(e).__name__}: {e}")] * len(idx)
            for i, x in zip(idx, scored):
                out[i] = x
        return out
    futures = [s.threads().submit(_call, s.scorer, r["response_text"], r["label"], r) for r in rows]
    out = []
    for fut in futures:
        try:
            out.append(checked_reward(fut.result(timeout=s.timeout_s), s.reward_key))
        except cf.TimeoutError:
            out.append(_failed("timeout", f"scorer took longer than {s.timeout_s}s"))
        except Exception as e:
            out.append(_failed("error", f"{type(e).__name__}: {e}"))
    return out


def has_reward(row: dict) -> bool:
    """The row holds a stored reward. A NaN or inf one (stored by a build before rewards were checked) counts as
    none, so the sample is scored again: re-scoring, rather than marking it failed, gives the real reward once
    the scorer is fixed, and a scorer still returning NaN now makes it that sample's failure (reward 0 with its
    reason). Either way the step can be trained, so a run stopped by such a row resumes (flows/rl.py)."""
    return row["reward"] is not None and trainable_reward(row["reward"])


def _usable(row: dict) -> bool:
    """A stored reward that did not fail: the step's reward source works, whatever a re-scored sample gives."""
    if not has_reward(row):
        return False
    try:
        details = json.loads(row.get("reward_details") or "{}")
    except ValueError:
        return True  # not ours: a reward stored with free text beside it
    return not (isinstance(details, dict) and "reward_status" in details)


@dataclass
class RewardResult:
    step: int
    scored: int
    already_scored: int
    errors: int


def score_step(*, store, run_id: str, step: int, settings: RewardSettings) -> RewardResult:
    rows = read_trajectories(store, run_id, step).to_pylist()
    # Aborted rows are unfinished partials: they are scored in the step that completes them. Failed rows are never
    # trained (storage/trajectories.py `is_usable`): a reward of their garbage would mean nothing.
    pending = [r for r in rows if not has_reward(r) and is_usable(r)]
    results = score_rows(pending, settings)
    failed = [details for _, details in results if "reward_status" in details]
    if failed and len(failed) == len(pending) and not any(_usable(r) for r in rows):
        # Every sample failed (a reward model answering 401, a scorer that always raises): storing zeros would
        # train on them, and a resume would trust them. Nothing is stored; a resume scores the step again.
        raise Fault(
            f"reward: all {len(pending)} samples of step {step} failed to score ({failed[0]['reward_status']}: "
            f"{failed[0]['message'].splitlines()[0][:300]}); no reward was stored. Fix the reward source, "
            f"then `sluiceway resume` scores the step again"
        )
    updates = [
        (r["group_id"], r["sample_index"], reward, json.dumps(details, default=str))
        for r, (reward, details) in zip(pending, results)
    ]
    if updates:
        set_rewards(store, run_id, step, updates)
    errors = sum("reward_status" in details for _, details in results)
    return RewardResult(step, len(updates), len(rows) - len(pending), errors)


def rescore_non_finite(*, store, run_id: str, step: int, settings: RewardSettings, table):
    """The step's rows, after scoring again any sample whose stored reward is NaN or inf (a build before rewards
    were checked stored them; the reward stage's ledger says the step is scored, so the train stage asks)."""
    rewards = table.column("reward").to_pylist()
    if all(r is None or trainable_reward(r) for r in rewards):
        return table
    score_step(store=store, run_id=run_id, step=step, settings=settings)
    return read_trajectories(store, run_id, step)
