"""`sluiceway tinker serve` as a subprocess for the tests that drive it with the real Tinker SDK
(tests/integration/test_tinker_sdk.py, test_tinker_cookbook.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from sluiceway.infra.proc import free_port

# What a Tinker program needs to talk to the local server offline: the SDK wants a key (any value), sends no
# telemetry, and the tokenizer the server names (a local directory) loads without the hub.
CLIENT_ENV = {"TINKER_API_KEY": "tml-local", "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}


class TinkerServer:
    """The server on a store in a temporary directory (`base`), with the session's cache; kill() and start()
    again on the same port and store."""

    def __init__(self, base: Path, cache: Path, base_model: str = "tiny-llama", server_id: str = "it",
                 extra: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.base, self.port, self.store = base, free_port(), base / "store"
        base.mkdir(parents=True, exist_ok=True)
        self.base_model, self.server_id, self.extra = base_model, server_id, extra
        self.env = dict(os.environ, SLUICEWAY_CACHE=str(cache), HF_HUB_OFFLINE="1", TINKER_TELEMETRY="0")
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 60) -> TinkerServer:
        self.starts += 1
        cmd = [sys.executable, "-m", "sluiceway.flows.cli", "tinker", "serve", "--base-model", self.base_model,
               "--port", str(self.port), "--work-dir", str(self.base / "work"), "--store", str(self.store),
               "--server-id", self.server_id, *self.extra]  # fmt: skip
        log_path = self.base / f"server{self.starts}.log"
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError("the server did not answer: " + log_path.read_text())

    def log_text(self) -> str:
        """What the server has printed since its last start."""
        return (self.base / f"server{self.starts}.log").read_text(errors="replace")

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
