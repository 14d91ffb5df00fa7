"""Issue 43, OpenEnv: an environment written against OpenEnv 0.10's API (tests/data/openenv_guess.py, a guessing
game of up to three steps) served for the run by openenv's own create_app on loopback (in .venv-openenv), trained
two steps on tiny-llama through the CLI: every row is an episode whose tokens are, turn by turn, what the engine
took in and gave out (its request log), the observations masked out, the reward the episode's return with the
per-step rewards stored. Then a server SIGKILLed mid-step: the session it held fails with the reason stored, a new
server takes the next sessions, and the run finishes. Protocol and failure details: tests/unit/rollout/
test_openenv_episodes.py."""

import json
import math
import os
import signal
import threading
import time

import pytest
from cli_run import run_cli
from paths import DATA
from test_agent_harnesses import check_row_against_engine

from sluiceway.infra.errors import UserError
from sluiceway.storage.metrics import read_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import is_trainable, read_trajectories
from sluiceway.tasks.environments.openenv_servers import openenv_python

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py

GAME = f"openenv:{DATA / 'openenv_guess.py'}:GuessGame"
ARGS = ["--prompt-data", GAME, "--openenv-action-parser", f"{DATA / 'openenv_guess_parser.py'}:parse",
        "--openenv-max-turns", "3", "--openenv-turn-tokens", "6", "--rollout-max-response-len", "96",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
        "--micro-batch-size", "8", "--env-size", "8", "--num-rollout", "2"]  # fmt: skip


@pytest.fixture(autouse=True)
def _openenv():
    try:
        openenv_python()
    except UserError as e:
        pytest.skip(f"no interpreter with openenv (make install makes .venv-openenv): {e}")


def rows_of(run_dir, step):
    return read_trajectories(ObjectStore.from_uri(str(run_dir / "tables")), "run", step).to_pylist()


def test_an_openenv_environment_trains_two_steps_with_the_engines_tokens(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "engine_requests.jsonl"
    run_cli(run_dir, tmp_path / "cache", *ARGS, env={"SLUICEWAY_ENGINE_REQUEST_LOG": str(log)})
    engine_log = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        engine_log[rec["rid"]] = rec
    turns = []
    for step in (0, 1):
        rows = [r for r in rows_of(run_dir, step) if is_trainable(r)]
        assert len(rows) == 8, [(r["status"], r["filter_reason"]) for r in rows_of(run_dir, step)]
        for r in rows:
            d = json.loads(r["reward_details"])
            assert d["source"] == "openenv" and d["steps"] == len(d["rewards"]) and r["reward"] == sum(d["rewards"])
            assert "I picked a number from 1 to 8" in r["prompt"]  # the reset observation is the prompt
            k = check_row_against_engine(r, engine_log, step)
            assert d["steps"] == k and (d["done"] or k == 3)  # every turn an action; done, or out of turns
            ids, mask = r["response_token_ids"], r["loss_mask"]
            masked = [t for t, m in zip(ids, mask, strict=True) if m == 0]
            assert (k == 1) == (not masked)
            turns.append(k)
    assert max(turns) > 1  # episodes of several steps
    m = read_metrics(ObjectStore.from_uri(str(run_dir / "tables")), "run").to_pylist()
    losses = {r["step"]: r["value"] for r in m if r["name"] == "train/loss"}
    assert set(losses) == {0, 1} and all(math.isfinite(v) for v in losses.values())


def test_a_killed_environment_server_costs_its_samples_not_the_run(tmp_path):
    run_dir, marker = tmp_path / "run", tmp_path / "killme"
    killed = []

    def killer():  # SIGKILLs the server once a step of its is under way (the game waits for it)
        pid_file = tmp_path / "killme.pid"
        end = time.monotonic() + 600
        while not pid_file.exists() or not pid_file.read_text():
            if time.monotonic() > end:
                return
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    # The class that is not declared safe for concurrent sessions: openenv serves it one session per server, so a
    # killed server costs one session (its group); of two groups each step needs one. Two sessions at once: two
    # servers (each start imports openenv, ~4 s of CPU), the killed one replaced.
    solo = ["--prompt-data", GAME.replace(":GuessGame", ":SoloGuessGame"), "--rollout-batch-size", "1",
            "--n-samples-per-prompt", "2", "--over-sampling-batch-size", "2", "--global-batch-size", "2",
            "--micro-batch-size", "2", "--rollout-max-concurrency", "2"]  # fmt: skip
    run_cli(run_dir, tmp_path / "cache", *ARGS, *solo, env={"GUESS_KILLME_ONCE": str(marker)})
    t.join(5)
    assert killed
    rows = rows_of(run_dir, 0) + rows_of(run_dir, 1)
    reasons = [json.loads(r["metadata"]).get("abort_reason") for r in rows if r["status"] == "aborted"]
    lost = [x for x in reasons if x and x.startswith("openenv: the environment server closed the connection")]
    assert lost, reasons
    assert len(lost) == 1, reasons  # the one session on the killed server
    logs = sorted(p.name for p in (run_dir / "openenv").iterdir())  # each server's stderr, kept
    assert len(logs) >= 3 and logs[0] == "openenv-server-1.log", logs  # two at once, the killed one replaced
    for step in (0, 1):  # the next sessions went to a new server: both steps trained
        assert len([r for r in rows_of(run_dir, step) if is_trainable(r)]) == 2
    m = read_metrics(ObjectStore.from_uri(str(run_dir / "tables")), "run").to_pylist()
    assert {r["step"] for r in m if r["name"] == "train/loss"} == {0, 1}
