"""Peak resident memory of a piece of work, measured in a fresh process (bench_recompute.py, bench_plan.py).

Each measurement runs in a subprocess of its own (`run_child`), so nothing one setting allocated (or one allocator
kept) is counted in the next. The child records its resident memory after its imports (`rss()`), resets the
kernel's high-water mark (`reset_peak()`: /proc/self/clear_refs, Linux) when it wants a phase of its own, and
reports `peak()` (VmHWM): the most it held at once, what an out-of-memory kill is decided on. Default glibc malloc
settings, as a run has them: torch's large tensors are mmap'd and go back to the system when freed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss() -> int:
    """Resident bytes now."""
    return _status("VmRSS")


def peak() -> int:
    """The most resident bytes since the process started or since `reset_peak()`."""
    return _status("VmHWM")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_child(script: Path, args: list[str], threads: int | None = None, env: dict | None = None) -> dict:
    """Run `script --child ARGS` in a fresh interpreter (`env` added to its environment); it prints one JSON
    object as its last line."""
    env = dict(os.environ) | (env or {})
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    out = subprocess.run([sys.executable, str(script), "--child", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=False)  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"{script.name} {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
