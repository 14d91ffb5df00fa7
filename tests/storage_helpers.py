"""Trajectory rows for the storage tests and a run-lock holder for spawned children (imported by name: tests/ is on
pytest's pythonpath)."""

import datetime as dt


def sample_row(step: int, group: int, sample: int, run_id: str = "run-a", **over) -> dict:
    n = 2 + sample  # responses of different lengths
    row = {
        "run_id": run_id,
        "step": step,
        "group_id": group,
        "sample_index": sample,
        "prompt_id": f"add:{group}",
        "prompt": f"What is {group} + 1?",
        "label": str(group + 1),
        "prompt_token_ids": [1, 2, 3, group],
        "response_token_ids": list(range(10, 10 + n)),
        "response_text": "x" * n,
        "rollout_logprobs": [-0.5] * n,
        "loss_mask": [1] * n,
        "status": "completed",
        "finish_reason": "stop",
        "weight_version": step,
        "weight_versions": [step],
        "engine": "embedded-0",
        "pool": "local",
        "gen_time_s": 0.25,
        "created_at": dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
        "metadata": {"temperature": 0.7},
    }
    row.update(over)
    return row


def batch(step: int, groups=(0, 1), samples=2, **over) -> list[dict]:
    return [sample_row(step, g, s, **over) for g in groups for s in range(samples)]


def hold_run_lock(run_dir, store, ready, stop) -> None:
    """Hold run r1's lock on `run_dir` and `store` until `stop` is set: the body of a spawned child. It lives here,
    not in a test module, so that the child imports only the lock, not the flows a test module imports (seconds
    per child)."""
    from sluiceway.storage import run_lock

    with run_lock.hold(run_dir, store, "r1", "run"):
        ready.set()
        stop.wait(60)


def hold_run_lock_and_fork(run_dir, store, ready, child_pid) -> None:
    """Hold run r1's lock, fork a child that outlives us (an environment's orphaned worker), put its pid in
    `child_pid` and end: the body of a spawned child."""
    import os
    import time

    from sluiceway.storage import run_lock

    with run_lock.hold(run_dir, store, "r1", "run"):
        pid = os.fork()
        if pid == 0:  # the orphan: sleeps on with whatever descriptors it inherited
            time.sleep(60)
            os._exit(0)
        child_pid.value = pid
        ready.set()
