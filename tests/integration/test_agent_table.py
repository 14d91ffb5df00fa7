"""Issue 32's table, re-run: each harness alone, pointed at the run through `--agent-function-path` on tiny-llama,
two steps of 2 prompts x 2 samples (examples/agent_harnesses.py). Every row trains, turn by turn the engine's
tokens. Slow (about 40 s a harness on 2 cores): `pytest -m slow tests/integration/test_agent_table.py`; the
default suite runs all ten harnesses in one run (test_agent_harnesses.py)."""

import json
import math

import pytest
from cli_run import run_cli
from paths import ROOT
from test_agent_harnesses import HARNESSES, check_row_against_engine

from sluiceway.storage.metrics import read_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import is_trainable, read_trajectories

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_harness_trains_two_steps(tmp_path, name):
    run_dir, cache, log = tmp_path / "run", tmp_path / "cache", tmp_path / "engine_requests.jsonl"
    agent = f"{ROOT / 'examples' / 'agent_harnesses.py'}:{name}"
    run_cli(run_dir, cache, "--num-rollout", "2", "--agent-function-path", agent, "--rollout-max-response-len", "128",
            "--rollout-max-prompt-len", "384", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--global-batch-size", "4", "--micro-batch-size", "4",
            env={"SLUICEWAY_ENGINE_REQUEST_LOG": str(log)})  # fmt: skip
    engine_log = {json.loads(line)["rid"]: json.loads(line) for line in log.read_text().splitlines()}
    store = ObjectStore.from_uri(str(run_dir / "tables"))
    for step in (0, 1):
        rows = [r for r in read_trajectories(store, "run", step).to_pylist() if is_trainable(r)]
        assert len(rows) == 4, [(r["status"], r["filter_reason"]) for r in rows]
        for r in rows:
            assert json.loads(r["reward_details"]) == {"source": "agent"}
            check_row_against_engine(r, engine_log, step)
    losses = {r["step"]: r["value"] for r in read_metrics(store, "run").to_pylist() if r["name"] == "train/loss"}
    assert set(losses) == {0, 1} and all(math.isfinite(v) for v in losses.values())
