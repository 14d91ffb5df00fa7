"""A disk that fills at different moments of a run (issue 30 item 9): tmpfs mounts of four sizes, so the disk is
full when Prefect's database is copied in, during the first steps (Prefect's server answers 500), while weights
are published, or while a checkpoint is written. Each time: exit 1 (never CPython's 120), exactly one line on
the terminal besides the run's INFO lines (no warning), the traceback whole in the file that line names, and a
resume after space is freed ends with the weights of an uninterrupted run. Needs root to mount a tmpfs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_run import BATCH, N, cli_args

from sluiceway.storage.integrity import check_tables
from sluiceway.storage.maintenance import RUN_TABLES
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import read_trajectories

STEPS = 3
SIZES = ["3m", "5m", "7m", "9m"]  # a run of 3 steps needs about 10 MB (5.5 of them Prefect's database)


def cli(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, SLUICEWAY_CACHE=str(cache))
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)


def resume_args(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "sluiceway.flows.cli", "resume", str(run_dir)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache) -> Path:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    done = cli(cli_args(run_dir, "--num-rollout", str(STEPS)), cache)
    assert done.returncode == 0, done.stdout + done.stderr
    return run_dir


def _mount(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode == 0


@pytest.mark.slow  # four failed runs and their resumes: about 5 minutes on 2 cores
@pytest.mark.parametrize("size", SIZES)
def test_a_full_disk_is_exit_1_and_one_line_wherever_it_fills(tmp_path, cache, reference, size):
    mount = tmp_path / "small"
    if not _mount(mount, size):
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN) on this machine")
    try:
        run_dir = mount / "run"
        failed = cli(cli_args(run_dir, "--num-rollout", str(STEPS)), cache)
        assert failed.returncode == 1, failed.stdout + failed.stderr  # 120: a flush failed at exit
        terminal = [ln for ln in failed.stderr.splitlines() if ln.strip() and " sluiceway INFO " not in ln]
        assert len(terminal) == 1, failed.stderr
        line = terminal[0]
        assert failed.stderr.rstrip("\n").endswith(line)  # the last line: nothing of the teardown after it
        assert line.startswith("error: disk full at ") and f"sluiceway resume {run_dir}" in line, line
        where = re.search(r"\(traceback in (\S+)\)$", line)
        if where:  # the run's log where it had room, else a file in the temporary directory
            text = Path(where.group(1)).read_text(errors="replace")
            traceback = text[text.rindex("the command failed: ") :]
            assert "Traceback (most recent call last)" in traceback
            last = traceback.rstrip("\n").splitlines()[-1]
            assert last and not last[0].isspace(), f"the traceback is cut: ...{traceback[-300:]}"
            if not Path(where.group(1)).is_relative_to(mount):
                Path(where.group(1)).unlink()
        check_tables(ObjectStore.from_uri(str(run_dir / "tables")), RUN_TABLES)  # nothing left unreadable
        subprocess.run(["mount", "-o", "remount,size=256m", str(mount)], check=True)
        resumed = cli(resume_args(run_dir), cache)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        got = torch.load(run_dir / "checkpoints" / "latest" / "tp0.pt", map_location="cpu", weights_only=False)
        want = torch.load(reference / "checkpoints" / "latest" / "tp0.pt", map_location="cpu", weights_only=False)
        assert got["step"] == want["step"] == STEPS - 1
        for name, tensor in want["model"].items():
            assert torch.equal(got["model"][name], tensor), name
        table = read_trajectories(ObjectStore.from_uri(str(run_dir / "tables")), run_dir.name)
        keys = list(zip(*(table.column(c).to_pylist() for c in ("step", "group_id", "sample_index"))))
        assert len(keys) == len(set(keys)) == STEPS * BATCH * N
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
