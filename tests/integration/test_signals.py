"""SIGINT and SIGTERM at any moment of a run, from its first import on (issue 30 item 7).

Each interrupted run must exit within 10 s with 130 (SIGINT) or 143 (SIGTERM), `interrupted` as the last line of
stderr and no traceback, leave no process behind (every process carrying the test's tag: engines, router,
Prefect's server, the trainer group), and be finished by `sluiceway resume`. Time zero is the moment the
`sluiceway` process has its handlers (SIGTERM caught, /proc/PID/status), which flows/cli/__init__.py installs before its
first slow import: a signal during the imports is the case that once ended in `KeyError: 'Algorithm already
exists in dispatch namespace'` (networkx half imported) and exit 1.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from cli_run import BATCH, N, cli_args
from process_tags import processes_tagged

from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import read_trajectories

STEPS = 2
EXIT_WITHIN_S = 10.0
TORCHRUN = ("--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2")  # a gloo trainer group


def start(args: list[str], cache: Path, tag: str) -> subprocess.Popen:
    env = dict(os.environ, SLUICEWAY_CACHE=str(cache), SLUICEWAY_TEST_TAG=tag)
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_command(run_dir: Path, *extra: str) -> list[str]:
    return cli_args(run_dir, "--num-rollout", str(STEPS), *extra)


def handlers_installed(pid: int) -> bool:
    """The process catches SIGTERM: flows/cli/__init__.py installed its handlers (Python itself catches only SIGINT)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(ln.split()[1], 16) for ln in f if ln.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def wait_for_handlers(proc: subprocess.Popen) -> float:
    """Time zero: when the handlers are in place (a few tens of ms after the interpreter started)."""
    deadline = time.monotonic() + 30
    while not handlers_installed(proc.pid):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the handlers were never installed"
        time.sleep(0.002)
    return time.monotonic()


def checkpoint_step(run_dir: Path) -> int | None:
    try:
        return yaml.safe_load((run_dir / "checkpoints" / "latest" / "meta.json").read_text())["step"]
    except (OSError, TypeError, KeyError, yaml.YAMLError):
        return None


def interrupt(run_dir: Path, cache: Path, sig: int, when, extra: tuple[str, ...] = ()) -> str:
    """Start a run, send `sig` when `when(t0)` says so (a delay in s after time zero, or a predicate), check how it
    ended; 'interrupted', or 'finished' if the run was done before the signal."""
    tag = f"signal-{uuid.uuid4().hex}"
    proc = start(run_command(run_dir, *extra), cache, tag)
    t0 = wait_for_handlers(proc)
    while not when(t0):
        if proc.poll() is not None:
            break
        time.sleep(0.005)
    if proc.poll() is not None:  # finished before the signal (a delay past the run's end)
        out, err = proc.communicate()
        assert proc.returncode == 0, out + err
        return "finished"
    sent = time.monotonic()
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        left = processes_tagged(tag)
        proc.kill()
        out, err = proc.communicate()
        for pid in processes_tagged(tag):
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"{signal.Signals(sig).name} at {sent - t0:.2f}s: still running after {EXIT_WITHIN_S}s "
                    f"(tagged processes {left}); stderr:\n{err[-3000:]}")  # fmt: skip
    what = f"{signal.Signals(sig).name} at {sent - t0:.2f}s"
    if proc.returncode == 0 and "done:" in out:
        return "finished"  # the signal came in the last instant, after the process had ended
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == 128 + sig, f"{what}: exit {proc.returncode}\n{err[-3000:]}"
    assert lines and lines[-1] == "interrupted", f"{what}: the last stderr line is not `interrupted`:\n{err[-3000:]}"
    assert "Traceback" not in err and not any(ln.startswith("error:") for ln in lines), f"{what}:\n{err[-3000:]}"
    while (left := processes_tagged(tag)) and time.monotonic() - sent < EXIT_WITHIN_S:
        time.sleep(0.05)
    assert not left, f"{what}: processes of the run alive {EXIT_WITHIN_S}s after the signal: {left}"
    return "interrupted"


def resume_finishes(run_dir: Path, cache: Path, extra: tuple[str, ...] = ()) -> None:
    """`sluiceway resume` finishes the run (or, interrupted before its record was written, `run` again does), with
    every step checkpointed and every trajectory stored once."""
    tag = f"signal-{uuid.uuid4().hex}"
    if (run_dir / "sluiceway-run.yaml").exists():
        args = [*cli_args(run_dir)[:3], "resume", str(run_dir)]
    else:
        args = run_command(run_dir, *extra)
    proc = start(args, cache, tag)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"{args[3]} after the signal failed:\n{out}\n{err[-3000:]}"
    assert checkpoint_step(run_dir) == STEPS - 1
    table = read_trajectories(ObjectStore.from_uri(str(run_dir / "tables")), run_dir.name)
    keys = list(zip(*(table.column(c).to_pylist() for c in ("step", "group_id", "sample_index"))))
    assert len(keys) == len(set(keys)) == STEPS * BATCH * N
    assert not processes_tagged(tag)


def same_weights(run_dir: Path, reference: Path) -> None:
    files = sorted(p.name for p in (reference / "checkpoints" / "latest").glob("tp*.pt"))
    for name in files:
        got, want = (torch.load(d / "checkpoints" / "latest" / name, map_location="cpu", weights_only=False)
                     for d in (run_dir, reference))  # fmt: skip
        for key, tensor in want["model"].items():
            assert torch.equal(got["model"][key], tensor), f"{name}: {key}"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def after(delay: float):
    return lambda t0: time.monotonic() - t0 >= delay


def test_sigint_and_sigterm_during_imports_and_mid_run(tmp_path, cache):
    """Three moments: SIGINT at once (the imports), SIGTERM once the run record is written (engines and Prefect's
    server starting), SIGINT once the first step's checkpoint is written (the second step running); the last
    one is resumed."""
    assert interrupt(tmp_path / "a", cache, signal.SIGINT, after(0.0)) == "interrupted"
    record = tmp_path / "b" / "sluiceway-run.yaml"
    assert interrupt(tmp_path / "b", cache, signal.SIGTERM, lambda t0: record.exists()) == "interrupted"
    run_dir = tmp_path / "c"
    assert interrupt(run_dir, cache, signal.SIGINT, lambda t0: checkpoint_step(run_dir) is not None) == "interrupted"
    resume_finishes(run_dir, cache)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache) -> tuple[Path, float]:
    """An uninterrupted run and how long it takes from time zero, measured on a warm cache (a first run builds
    tiny-llama and Prefect's template database: seconds that the interrupted runs do not spend)."""
    if not any(cache.iterdir()):
        warm = tmp_path_factory.mktemp("warm-up") / "run"
        out = subprocess.run(run_command(warm), env=dict(os.environ, SLUICEWAY_CACHE=str(cache)), capture_output=True)
        assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = start(run_command(run_dir), cache, f"signal-{uuid.uuid4().hex}")
    t0 = wait_for_handlers(proc)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err
    return run_dir, time.monotonic() - t0


@pytest.mark.slow  # 20 interrupted runs and 8 resumes: about 9 minutes on 2 cores
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signals_at_seeded_random_moments(tmp_path, cache, reference, sig):
    """10 runs per signal, each interrupted at a seeded random moment between time zero and the end of an
    uninterrupted run; every third one (and one with a torchrun trainer group) is resumed and must end with the
    uninterrupted run's weights."""
    reference_dir, length = reference
    rng = random.Random(30 + sig)
    outcomes = []
    for i in range(10):
        extra = TORCHRUN if i == 9 else ()
        delay = rng.uniform(0.0, length)
        run_dir = tmp_path / f"run{i}"
        outcome = interrupt(run_dir, cache, sig, after(delay), extra)
        outcomes.append((round(delay, 2), outcome))
        if i % 3 == 0 or extra:
            resume_finishes(run_dir, cache, extra)
            if not extra:
                same_weights(run_dir, reference_dir)
    print(f"{signal.Signals(sig).name}: run of {length:.1f}s; (delay, outcome): {outcomes}")
    assert sum(o == "interrupted" for _, o in outcomes) >= 7, outcomes
