"""A group of rollout engines behind one sglang-router: engines we start, and engines someone else runs.

    with SGLangRouter(log_dir) as router, EngineGroup("tiny-llama", 2, log_dir, router=router) as group:
        client = EngineClient(router.url, group.urls)

A group is what one process runs behind its own router: a run's engines (flows/engines.py), a pool's at its site
(flows/pools.py), a teacher's. "Pool" is kept for a remote site a run sends groups of samples to
(tasks/rollout/pool_directory.py), and for Prefect's work pool.

Started engines are ``sluiceway engine`` processes (the embedded engine, SGLang's HTTP API) on free loopback
ports, each in its own process group with its log in ``log_dir``; they are registered with the router only
once ``/health`` answers, so the router never sees a half-started engine. External engines
(``--rollout-external-engine-addrs``) are attached and detached, never started or stopped.

The router marks a dead worker unhealthy but keeps it listed (see :mod:`sluiceway.infra.router`); ``check()``
is what removes dead engines from the router, and what the rollout calls between batches.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx

from sluiceway.infra.proc import child_env, die_with_parent, free_port
from sluiceway.infra.router import HOST, SGLangRouter, log_tail, stop_process_group


class EngineGroupError(RuntimeError):
    pass


@dataclass
class EngineProcess:
    """One engine of the group: a process we started, or an external URL we only route to."""

    url: str
    process: subprocess.Popen | None = None  # None: external, not ours to stop
    log_path: Path | None = None
    failures: int = field(default=0)  # consecutive failed health checks

    @property
    def external(self) -> bool:
        return self.process is None


def _normalize(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"  # slime's addrs are often bare host:port


class EngineGroup:
    """Owns ``num_engines`` engine processes (plus any external URLs) and keeps the router's worker list in step."""

    def __init__(
        self,
        model: str | None,
        num_engines: int,
        log_dir: str | Path,
        router: SGLangRouter | None = None,
        external_urls: list[str] | tuple[str, ...] = (),
        engine_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        threads_per_engine: int | None = None,
        startup_timeout_s: float = 300.0,
        health_timeout_s: float = 5.0,
        failure_threshold: int = 2,
        launcher: Callable[[int, int], tuple[list[str], dict[str, str]]] | None = None,
    ) -> None:
        if num_engines and not model:
            raise ValueError("EngineGroup: a model is needed to start engines")
        self.model = model
        self.num_engines = num_engines
        self.log_dir = Path(log_dir)
        self.router = router
        self.external_urls = [_normalize(u) for u in external_urls]
        self.engine_args = tuple(engine_args)
        self.env = env
        # (engine index, port) -> (command, extra env): how to start an engine other than `sluiceway engine`,
        # e.g. an SGLang server pinned to its GPUs (infra/sglang_launcher.py).
        self.launcher = launcher
        # Engines share the CPU: without a cap every one starts a thread per core and they thrash.
        self.threads_per_engine = threads_per_engine or max(1, (os.cpu_count() or 1) // max(1, num_engines))
        self.startup_timeout_s = startup_timeout_s
        self.health_timeout_s = health_timeout_s
        self.failure_threshold = failure_threshold
        self.engines: list[EngineProcess] = []
        self._http = httpx.Client(timeout=health_timeout_s, trust_env=False)
        self._started = False
        self._ready = False

    @property
    def urls(self) -> list[str]:
        """Every engine still in the group (started and external), in start order."""
        return [e.url for e in self.engines]

    def _engine_env(self) -> dict[str, str]:
        env = child_env()  # SLUICEWAY_CACHE, HF_*, device settings; no credentials (infra/proc.py)
        t = str(self.threads_per_engine)
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(key, t)
        env.update(self.env or {})
        return env

    def _command(self, port: int) -> list[str]:
        return [
            sys.executable, "-m", "sluiceway.flows.cli", "engine",
            "--model", str(self.model), "--host", HOST, "--port", str(port),
            *self.engine_args,
        ]  # fmt: skip

    def _spawn(self, index: int) -> EngineProcess:
        port = free_port()
        log_path = self.log_dir / f"engine-{index}.log"
        command, extra_env = self.launcher(index, port) if self.launcher else (self._command(port), {})
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self._engine_env(), **extra_env},
                start_new_session=True,  # own process group: stop()/kill() reach its children too
                preexec_fn=die_with_parent,  # a SIGKILLed flow leaves no engines behind
            )
        return EngineProcess(url=f"http://{HOST}:{port}", process=proc, log_path=log_path)

    def start(self) -> Self:
        """Spawn the engines and wait until every one is healthy (and behind the router)."""
        return self.spawn().wait_ready()

    def spawn(self) -> Self:
        """Launch the embedded engines without waiting for them: several groups can then load their models at
        once, from the thread that owns them (engines die with the thread that started them: infra/proc.py)."""
        if self._started:
            return self
        self._started = True
        self.log_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        try:
            # All engines load their model at once; waiting one by one would serialize the startup.
            self.engines.extend(self._spawn(i) for i in range(self.num_engines))
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> Self:
        if self._ready:
            return self
        try:
            self._wait_healthy(list(self.engines), self.startup_timeout_s)
            external = [EngineProcess(url=u) for u in self.external_urls]
            self._wait_healthy(external, min(self.startup_timeout_s, 60.0))
            self.engines.extend(external)
            if self.router is not None:
                for e in self.engines:
                    self.router.add_worker(e.url)
        except BaseException:
            self.stop()
            raise
        self._ready = True
        return self

    def _healthy(self, url: str) -> bool:
        try:
            return self._http.get(f"{url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _wait_healthy(self, engines: list[EngineProcess], timeout_s: float) -> None:
        pending = list(engines)
        deadline = time.monotonic() + timeout_s
        respawns = 0
        while pending:
            for e in list(pending):
                if e.process is not None and e.process.poll() is not None:
                    if respawns < 3 and e in self.engines and self._lost_port_race(e):
                        # free_port's port was taken before the engine bound it (busy machines): a new port
                        respawns += 1
                        again = self._spawn(self.engines.index(e))
                        self.engines[self.engines.index(e)] = again
                        pending[pending.index(e)] = again
                        continue
                    raise EngineGroupError(
                        f"engine {e.url} exited with code {e.process.returncode} while starting; "
                        f"log {e.log_path}:\n{log_tail(e.log_path)}"
                    )
                if self._healthy(e.url):
                    pending.remove(e)
            if pending and time.monotonic() > deadline:
                where = ", ".join(f"{e.url} (log {e.log_path})" if e.log_path else e.url for e in pending)
                raise EngineGroupError(f"engines not healthy in {timeout_s:.0f}s: {where}")
            if pending:
                time.sleep(0.2)

    def _lost_port_race(self, e: EngineProcess) -> bool:
        """Whether the engine exited because its port was in use (uvicorn logs errno 98 and exits with 3)."""
        return e.log_path is not None and "address already in use" in log_tail(e.log_path).lower()

    def check(self) -> list[str]:
        """Drop engines that died (process exited, or ``failure_threshold`` failed health checks in a row):
        they leave the group and the router. Returns their URLs."""
        dead: list[EngineProcess] = []
        for e in self.engines:
            if e.process is not None and e.process.poll() is not None:
                dead.append(e)
                continue
            # A busy engine on a loaded CPU can miss one check: only consecutive misses count.
            e.failures = 0 if self._healthy(e.url) else e.failures + 1
            if e.failures >= self.failure_threshold:
                dead.append(e)
        for e in dead:
            self.engines.remove(e)
            if self.router is not None:
                self.router.remove_worker(e.url)
            if e.process is not None:
                stop_process_group(e.process, grace_s=1.0)  # reap it and anything it left behind
        return [e.url for e in dead]

    def kill(self, index: int) -> str:
        """SIGKILL engine ``index`` (tests: a crash mid-rollout). It stays listed until ``check()``."""
        e = self.engines[index]
        if e.process is None:
            raise EngineGroupError(f"engine {e.url} is external: not ours to kill")
        os.killpg(e.process.pid, signal.SIGKILL)
        e.process.wait()
        return e.url

    def stop(self) -> None:
        """Detach every engine from the router and stop the ones we started (external ones keep running)."""
        for e in self.engines:
            if self.router is not None and self.router.process is not None:
                try:
                    self.router.remove_worker(e.url, timeout_s=5.0)
                except Exception:  # noqa: BLE001 - stopping must not leave engines running
                    pass
        ours = [e.process for e in self.engines if e.process is not None]
        for proc in ours:  # SIGTERM all first, so they shut down side by side
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in ours:
            stop_process_group(proc)
        self._started = self._ready = False
        atexit.unregister(self.stop)

    def close(self) -> None:
        self.stop()
        self._http.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
