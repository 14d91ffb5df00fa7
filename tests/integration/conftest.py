"""Runs that several integration test modules share: one `sluiceway run`, read (or copied) by every test that
asks for it, instead of one identical run per module (the suite's budget, issue 39 point 6)."""

from __future__ import annotations

import pytest
from cli_run import run_cli


@pytest.fixture(scope="session")
def two_step_run(tmp_path_factory):
    """A finished 2-step run with cli_run's settings (`run_cli(run_dir, cache, "--num-rollout", "2")`), run id
    "run", and the cache it was made with. Tests never write to it: test_replay_eval.py replays and evaluates it
    into directories of its own, test_faults.py copies it (copy_run) before extending or damaging it."""
    base = tmp_path_factory.mktemp("two-step-run")
    run_dir, cache = base / "run", base / "cache"
    run_cli(run_dir, cache, "--num-rollout", "2")
    return run_dir, cache

