"""A real Prefect server for tests, started through `sluiceway server` on a loopback port and stopped by pid.

Also the small REST helpers the deployment tests use (the API the UI itself talks to).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from paths import DATA

from sluiceway.infra.proc import free_port

# The tiny run the deployment tests trigger: tiny-llama, 2 steps of 2 prompts x 2 samples.
SCORER = str(DATA / "noise_rewards.py") + ":vowel_share"
TINY_RUN_FLAGS = [
    "--prompt-data", "env:arithmetic", "--hf-checkpoint", "tiny-llama", "--rollout-batch-size", "2",
    "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--micro-batch-size", "4",
    "--rollout-max-response-len", "4", "--num-rollout", "2", "--env-size", "8", "--seed", "5",
    "--custom-rm-path", SCORER, "--lr", "1e-3",
]  # fmt: skip
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def sluiceway_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "sluiceway.flows.cli", *args]


def stop(proc: subprocess.Popen, timeout: float = 20) -> None:
    """Stop a process started with start_new_session=True, and the children in its session, by its pid."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


class PrefectServer:
    def __init__(self, base: Path, port: int | None = None):
        self.base = Path(base)
        self.port = port or free_port()
        self.home = self.base / "prefect-home"
        self.url = f"http://127.0.0.1:{self.port}"
        self.api = self.url + "/api"
        self.log = self.base / "server.log"
        self.proc: subprocess.Popen | None = None

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a client process (worker, serve, CLI) of this server."""
        env = dict(os.environ)
        env.update(
            PREFECT_API_URL=self.api,
            PREFECT_HOME=str(self.base / "client-home"),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL="WARNING",
            PREFECT_WORKER_QUERY_SECONDS="1",
            PREFECT_RUNNER_POLL_FREQUENCY="1",
        )
        env.update(extra)
        return env

    def __enter__(self) -> PrefectServer:
        self.base.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                sluiceway_cmd("server", "--port", str(self.port), "--home", str(self.home)),
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect server exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.api + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        stop(self.proc)
        raise RuntimeError(f"prefect server not ready in 180 s: {self.log.read_text()[-3000:]}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            stop(self.proc)

    # REST helpers -----------------------------------------------------------------------------------
    def get(self, path: str) -> dict | list:
        r = httpx.get(self.api + path, timeout=30)
        r.raise_for_status()
        return r.json()

    def post(self, path: str, body: dict | None = None) -> dict | list:
        r = httpx.post(self.api + path, json=body or {}, timeout=30)
        r.raise_for_status()
        return r.json()

    def deployment(self, flow: str, name: str) -> dict:
        return self.get(f"/deployments/name/{flow}/{name}")

    def flow_runs_of(self, deployment_id: str) -> list[dict]:
        return self.post("/flow_runs/filter", {"deployments": {"id": {"any_": [deployment_id]}}})

    def wait_flow_run(self, flow_run_id: str, timeout: float = 420) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = self.get(f"/flow_runs/{flow_run_id}")
            if run["state_type"] in TERMINAL:
                return run
            time.sleep(1)
        raise TimeoutError(f"flow run {flow_run_id} not finished in {timeout} s: {run['state_type']}")

    def artifacts_of(self, flow_run_id: str) -> list[dict]:
        return self.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})

    def logs_of(self, flow_run_id: str) -> str:
        logs = self.post("/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200})
        return "\n".join(entry["message"] for entry in logs)
