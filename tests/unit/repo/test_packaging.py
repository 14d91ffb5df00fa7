"""pyproject.toml lists its packages by hand (the five top-level directories become `sluiceway.*`): a package left off
the list still imports in the editable install `make install` makes, and is missing from a wheel. Both checks here
fail on such an omission (issue 41's slime names and issue 42's Tinker server were first left off)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("flows", "tasks", "storage", "models", "infra")
DATA_ONLY = "tasks/rollout/slime_plugins/names"  # slime's names: files imported as `slime.*`, package data here


def project_files() -> list[Path]:
    return sorted(p.relative_to(ROOT) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if "__pycache__" not in p.parts)  # fmt: skip


def test_every_package_directory_is_listed():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, dirs = set(setuptools["packages"]), setuptools["package-dir"]
    for init in (p for p in project_files() if p.name == "__init__.py"):
        if str(init.parent).startswith(DATA_ONLY):
            continue
        name = "sluiceway." + ".".join(init.parent.parts)
        assert name in listed and dirs.get(name) == str(init.parent), f"pyproject.toml lacks {name} = {init.parent}"


def test_the_wheel_holds_every_module(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(ROOT),
         "-w", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("sluiceway-*.whl")
    inside = set(zipfile.ZipFile(wheel).namelist())
    missing = [str(f) for f in project_files() if f"sluiceway/{f}" not in inside]
    assert not missing, f"not in the wheel: {missing[:10]}"
