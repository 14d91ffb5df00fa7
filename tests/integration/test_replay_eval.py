"""`sluiceway replay` and `sluiceway eval` on tiny-llama: training again from a stored table version with no
engine running, one-line errors for a bad run or version, and evaluating a run's published weights."""

import datetime as dt
import os
import shutil
import subprocess
import sys

import pytest
import torch
from cli_run import BATCH, SCORER, N
from safetensors.torch import load_file

from sluiceway.infra.errors import UserError
from sluiceway.models.zoo import load_hf_model, resolve_checkpoint
from sluiceway.storage.metrics import read_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.tables import open_table, table_version
from sluiceway.storage.trajectories import TRAJECTORIES, read_trajectories
from sluiceway.tasks.train.replay import open_source, replay_batches, resolve_version

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py


def sluiceway(cache, *args):
    env = dict(os.environ, SLUICEWAY_CACHE=str(cache))
    cmd = [sys.executable, "-m", "sluiceway.flows.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def last_version_without(store, run_id, step) -> int:
    """The last trajectories table version at which `step` has no rows yet."""
    v = table_version(store, TRAJECTORIES)
    while v >= 0 and step in read_trajectories(store, run_id, version=v).column("step").to_pylist():
        v -= 1
    return v


RUN = "run"  # the run id of the session's two-step run (tests/integration/conftest.py)


@pytest.fixture(scope="module")
def stored(two_step_run):
    """A finished 2-step RL run (`run_cli(..., "--num-rollout", "2")`, shared with test_faults.py: read here, never
    written), and the table version after its step 0 (before any row of step 1)."""
    run_dir, cache = two_step_run
    assert run_dir.name == RUN
    store = ObjectStore.from_uri(str(run_dir / "tables"))
    return run_dir, cache, store, last_version_without(store, RUN, 1)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """This module's output directories (the replay, the eval), beside no one else's."""
    return tmp_path_factory.mktemp("replay")


def replay_args(run_dir, out, *extra):
    return (
        "replay", "--replay-run-id", RUN, "--replay-tables", str(run_dir / "tables"),
        "--output-dir", str(out), "--hf-checkpoint", "tiny-llama", "--rollout-temperature", "1.0", "--lr", "1e-3",
        "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N), "--global-batch-size", str(BATCH * N),
        "--micro-batch-size", "8", "--save-interval", "1", *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def replayed(stored, work):
    run_dir, cache, _, version = stored
    out = work / "replay-out"
    proc = sluiceway(cache, *replay_args(run_dir, out, "--replay-version", str(version)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc


def test_table_version_to_step_batches(stored):
    run_dir, _, store, version = stored
    latest = open_source(store, RUN)
    assert latest.steps == [0, 1] and latest.version == table_version(store, TRAJECTORIES)
    source = open_source(store, RUN, version=version)
    assert source.steps == [0]  # step 1 had not been written at that version
    [(step, samples)] = list(replay_batches(source, "grpo", True))
    rows = read_trajectories(store, RUN, 0, version=version).to_pylist()
    assert step == 0 and len(samples) == len(rows) == BATCH * N
    # The stored engine log-probs travel with each sample (the behaviour policy); advantages are recomputed.
    assert [s.rollout_logprobs for s in samples] == [r["rollout_logprobs"] for r in rows]
    assert abs(sum(s.advantage for s in samples)) < 1e-4 and any(s.advantage != 0 for s in samples)
    # Time travel by timestamp: the moment of that commit reads the same version.
    when = next(h["timestamp"] for h in open_table(store, TRAJECTORIES).history() if h["version"] == version)
    assert resolve_version(store, timestamp=dt.datetime.fromtimestamp(when / 1000, dt.UTC)) == version
    with pytest.raises(UserError, match="before the first commit"):
        resolve_version(store, timestamp=dt.datetime(2000, 1, 1))
    with pytest.raises(UserError, match="--replay-steps"):
        open_source(store, RUN, version=version, steps=[1])


def test_replay_module_never_loads_the_engine_side():
    code = (
        "import sys, sluiceway.flows.replay; "
        "engine_side = ('sluiceway.flows.engines', 'sluiceway.models.engine', 'sluiceway.infra.router', "
        "'sluiceway.infra.engine_group', 'sluiceway.infra.sglang_launcher', 'sluiceway.tasks.rollout'); "
        "bad = [m for m in sys.modules if m.startswith(engine_side)]; "
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_replay_trains_from_the_table_version(stored, replayed):
    run_dir, cache, _, version = stored
    out, proc = replayed
    assert "replay step   0 (1/1)" in proc.stdout and "replay step   1" not in proc.stdout
    # RolloutEngines creates OUTPUT_DIR/logs for the router and engine logs before it starts either.
    assert not (out / "logs").exists()
    m = read_metrics(ObjectStore.from_uri(str(out / "tables")), "replay-out").to_pylist()
    assert {r["step"] for r in m} == {0}  # exactly the steps stored at that version
    assert {r["value"] for r in m if r["name"] == "replay/table_version"} == {float(version)}
    assert {r["value"] for r in m if r["name"] == "samples"} == {float(BATCH * N)}
    hf = load_hf_model(resolve_checkpoint("tiny-llama", cache_dir=cache))
    published = load_file(out / "weights" / "v000001" / "model.safetensors")
    changed = [k for k, v in published.items() if not torch.equal(v, hf.state_dict()[k])]
    assert len(changed) >= len(published) // 2, f"only {len(changed)} of {len(published)} tensors changed"
    assert (out / "checkpoints" / "replay" / "meta.json").exists()


def test_replay_resumes_and_keeps_its_version(stored, replayed):
    run_dir, cache, store, _ = stored
    out, _ = replayed
    again = sluiceway(cache, *replay_args(run_dir, out))  # no version given: the pinned one, all steps done
    assert again.returncode == 0, again.stdout + again.stderr
    assert "replay step" not in again.stdout and f"replayed 0 steps (1 in {RUN} @" in again.stdout
    latest = str(table_version(store, TRAJECTORIES))
    other = sluiceway(cache, *replay_args(run_dir, out, "--replay-version", latest))
    assert other.returncode == 2 and other.stderr.count("\n") == 1 and "use a new --output-dir" in other.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--replay-version", "9999"), "error: --replay-version 9999: the trajectories table at"),
        (("--replay-run-id", "nope"), "error: --replay-run-id nope: no trajectories of that run"),
        (("--replay-version", "0"), f"error: replay: step 0 of run {RUN} has unscored samples"),  # mid-step
    ],
)
def test_replay_user_errors_are_one_line(stored, flags, message, tmp_path):
    run_dir, cache, _, _ = stored
    proc = sluiceway(cache, *replay_args(run_dir, tmp_path / "bad-replay"), *flags)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr


def test_eval_of_published_weights(stored, replayed):
    _, cache, _, _ = stored
    out, _ = replayed
    ev = out.parent / "eval-out"
    proc = sluiceway(
        cache, "eval", "--hf-checkpoint", str(out / "weights"), "--eval-prompt-data", "arith", "env:arithmetic",
        "--eval-size", "4", "--n-samples-per-eval-prompt", "2", "--rollout-max-response-len", "8",
        "--custom-rm-path", SCORER, "--output-dir", str(ev),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("eval arith")]
    assert "pass@1" in line and "pass@2" in line and "(4 prompts)" in line
    m = read_metrics(ObjectStore.from_uri(str(ev / "tables")), "eval-out").to_pylist()
    assert {r["step"] for r in m} == {1}  # stored at the weights' version (weights/v000001)
    scores = {r["name"]: r["value"] for r in m}
    assert scores["eval/arith/prompts"] == 4.0 and 0.0 <= scores["eval/arith/pass@2"] <= 1.0


def test_eval_of_damaged_published_weights_is_one_line(stored, replayed, tmp_path):
    _, cache, _, _ = stored
    out, _ = replayed
    damaged = tmp_path / "weights" / "v000001"
    shutil.copytree(out / "weights" / "v000001", damaged)
    data = bytearray((damaged / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (damaged / "model.safetensors").write_bytes(bytes(data))
    proc = sluiceway(
        cache, "eval", "--hf-checkpoint", str(damaged), "--eval-prompt-data", "arith", "env:arithmetic",
        "--eval-size", "4", "--rollout-max-response-len", "8", "--custom-rm-path", SCORER,
        "--output-dir", str(tmp_path / "eval-out"),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and " INFO " not in ln]
    assert len(lines) == 1 and lines[0].startswith(f"error: weights {damaged}/model.safetensors does not match"), lines
