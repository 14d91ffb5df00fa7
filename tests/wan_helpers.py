"""A remote pool behind a WAN-like link (sluiceway.infra.netns): `sluiceway pools up` run inside the link's
namespace, reaching the weight store only through a delaying proxy on the home end, and reached by the run
through a second proxy on the remote end. Shared by tests/integration/test_wan_link.py and
benchmarks/bench_wan.py.

    home namespace                                   | "remote" namespace (veth pair, shaped with tc)
      SeaweedFS 127.0.0.1:S <- store proxy 10.77.0.1:P <--- pool agent (AWS_ENDPOINT_URL=http://10.77.0.1:P)
      the run (--rollout-pools remote=http://10.77.0.2:Q) ---> router proxy 10.77.0.2:Q -> router 127.0.0.1:R
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from sluiceway.infra.netns import DelayProxy, WanLink

_POOL_LINE = re.compile(r"^pool (\S+) \(.*\): (http://127\.0\.0\.1:(\d+))")


@dataclass
class RemotePool:
    name: str
    link: WanLink
    url: str  # the router through the link, as the run reaches it (router proxy on the remote end)
    local_url: str  # the router as seen inside the namespace
    status_path: Path
    process: subprocess.Popen
    log_path: Path
    proxy: DelayProxy
    lines: list[str] = field(default_factory=list)

    def status(self) -> dict:
        """The agent's status.json (the file system is shared; only the network is not)."""
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {}

    @property
    def current(self) -> Path:
        return self.status_path.parent / "current"  # the agent's materialized copy (renamed into place)

    def held(self) -> int | None:
        try:
            return json.loads((self.current / "manifest.json").read_text())["version"]
        except (OSError, ValueError, KeyError):
            return None

    def wait_serving(self, version: int, timeout_s: float = 300.0, poll_s: float = 0.02) -> dict[str, float]:
        """Block until every engine of the pool serves ``version``. Returns time.monotonic() when the agent held
        it (downloaded and applied: ``held``) and when the engines served it (``serving``)."""
        deadline = time.monotonic() + timeout_s
        seen: dict[str, float] = {}
        while time.monotonic() < deadline:
            now = time.monotonic()
            if "held" not in seen and (self.held() or -1) >= version:
                seen["held"] = now
            if self.status().get("version") == version:
                seen.setdefault("held", now)
                seen["serving"] = now
                return seen
            if self.process.poll() is not None:
                raise RuntimeError(f"pool {self.name} exited ({self.process.returncode}):\n{self.log_tail()}")
            time.sleep(poll_s)
        raise TimeoutError(f"pool {self.name} did not serve v{version} within {timeout_s:.0f}s: {self.status()}\n"
                           f"{self.log_tail()}")  # fmt: skip

    def generate_inside(self, timeout_s: float = 60.0) -> str:
        """weight_version of a /generate answered by the pool's router, asked from inside its namespace."""

        def ask() -> str:
            body = {"input_ids": [1, 5, 9], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
            r = httpx.post(f"{self.local_url}/generate", json=body, timeout=timeout_s, trust_env=False)
            r.raise_for_status()
            return str(r.json()["meta_info"]["weight_version"])

        return self.link.call(ask)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@contextlib.contextmanager
def remote_pool(
    link: WanLink,
    work_dir: Path,
    *,
    model: str,
    weights_uri: str,
    store_env: dict[str, str],
    name: str = "remote",
    num_engines: int = 1,
    poll_interval_s: float = 0.5,
    delay_s: float = 0.0,
    reset_fraction: float = 0.0,
    engine_args: list[str] | None = None,
    startup_timeout_s: float = 300.0,
    router_port: int | None = None,
    capacity: int | None = None,
    heartbeat_s: float | None = None,
) -> Iterator[RemotePool]:
    """`sluiceway pools up` with one pool inside ``link``'s namespace; stopped (and its proxy) on exit.

    ``store_env``: the AWS_* the pool's agent uses (its endpoint the store proxy's URL on the home end).
    ``delay_s``/``reset_fraction``: the router proxy's, for the run's requests to the pool.
    ``router_port``: the router listens there, and the router proxy starts before the pool, so the pool registers
    the proxy's URL (what a run with `--rollout-pools auto` then uses); ``capacity``/``heartbeat_s`` go into its
    record."""
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    pools_file = work_dir / "pools.yaml"
    pool = {"name": name, "region": f"netns:{link.name}", "model": model, "num_engines": num_engines,
            "weights_uri": weights_uri, "poll_interval_s": poll_interval_s,
            "engine_args": engine_args or []}  # fmt: skip
    proxy = None
    if router_port is not None:
        proxy = DelayProxy((link.remote_ip, 0), ("127.0.0.1", router_port), delay_s=delay_s,
                           reset_fraction=reset_fraction, listen_ns=link.name, target_ns=link.name).start()  # fmt: skip
        pool.update(router_port=router_port, url=proxy.url)
    pool.update({k: v for k, v in (("capacity", capacity), ("heartbeat_s", heartbeat_s)) if v is not None})
    pools_file.write_text(yaml.safe_dump({"pools": [pool]}))
    log_path = work_dir / "pools.log"
    env = dict(os.environ, **store_env)
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "sluiceway.flows.cli", "pools", "up", str(pools_file), "--work-dir", str(work_dir)]
    with open(log_path, "ab") as log:
        proc = link.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:  # every line of stdout, kept; the router's URL flagged once seen
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            lines.append(line)
            if _POOL_LINE.match(line):
                found.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not found.wait(0.2):
            if proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with {proc.returncode}" if proc.poll() is not None else "timed out"
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
                raise RuntimeError(f"remote pool {why} before serving:\n{tail}")
        m = next(m for m in map(_POOL_LINE.match, lines) if m)
        if proxy is None:
            proxy = DelayProxy((link.remote_ip, 0), ("127.0.0.1", int(m.group(3))), delay_s=delay_s,
                               reset_fraction=reset_fraction, listen_ns=link.name,
                               target_ns=link.name).start()  # fmt: skip
        yield RemotePool(name, link, proxy.url, m.group(2), work_dir / name / "agent" / "status.json", proc,
                         log_path, proxy, lines)  # fmt: skip
    finally:
        if proxy is not None:
            proxy.stop()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # pools up unwinds: agent, engines, router
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
