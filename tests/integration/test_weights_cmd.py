"""`sluiceway weights` (alias `ckpt`): the command is named after what it manages, the old name still works."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.shared_prefect  # its runs use the worker's Prefect server: tests/integration/conftest.py


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluiceway.flows.cli", *args], capture_output=True, text=True)


def test_weights_and_its_alias_read_the_same_store(tmp_path):
    for name in ("weights", "ckpt"):
        r = cli(name, "ls", "--store", str(tmp_path))
        assert r.returncode == 0 and r.stdout == f"no weight versions under {tmp_path}\n", r.stderr
        r = cli(name, "ls", "--store", str(tmp_path / "missing"))
        assert r.returncode == 2 and r.stderr == f"error: weights: --store {tmp_path / 'missing'} is not a directory\n"
