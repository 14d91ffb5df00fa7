"""Embedded Prefect: its home lives inside the run directory, quiet and without telemetry.

Prefect reads its settings when first imported, so call `configure_prefect` before importing prefect.
A user who already points PREFECT_API_URL at a real server (for the UI) keeps it. Otherwise sluiceway starts
the embedded API server itself rather than leaving it to Prefect's ephemeral mode: Prefect's own subprocess
outlives a SIGKILLed flow, while ours is tied to it (infra/proc.py), and we choose how long a loaded machine
may take to start it.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from sluiceway.infra.proc import die_with_parent
from sluiceway.infra.router import free_port, stop_process_group

START_TIMEOUT_S = 180.0


def configure_prefect(run_dir: str | Path) -> Path:
    home = Path(run_dir).resolve() / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    # Results are small JSON-able summaries (table versions, counts); persisting them lets a retried
    # flow see what already ran.
    os.environ.setdefault("PREFECT_RESULTS_PERSIST_BY_DEFAULT", "true")
    os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", str(home / "results"))
    if not os.environ.get("PREFECT_API_URL"):
        os.environ["PREFECT_API_URL"] = start_api_server(home)
    return home


def start_api_server(home: Path, timeout_s: float = START_TIMEOUT_S) -> str:
    """Prefect's API (no UI) on a loopback port, as a child that dies with this process; returns its URL."""
    port = free_port()
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_UI_ENABLED="0", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env.pop("PREFECT_API_URL", None)
    log = open(home / "api-server.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True, preexec_fn=die_with_parent,
    )  # fmt: skip
    atexit.register(stop_process_group, proc)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the embedded Prefect API server exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_process_group(proc)
            raise RuntimeError(f"the embedded Prefect API server did not start within {timeout_s:.0f}s; see {log.name}")
        time.sleep(0.2)
