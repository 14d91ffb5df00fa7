"""Where an openenv: source's episodes connect: a running server (`openenv:URL`), or servers the run starts on
loopback for an environment class (`openenv:MODULE:Class`), in the interpreter that has openenv.

openenv 0.10 cannot share a venv with verifiers (they pin different `mcp`), so the class is served by
tasks/environments/openenv_serve.py under another interpreter: $SLUICEWAY_OPENENV_PYTHON, else this one if it
can import openenv, else the checkout's .venv-openenv (the Makefile makes it). The run itself only speaks the
protocol (openenv_client.py).

A class that declares SUPPORTS_CONCURRENT_SESSIONS = True is one server holding up to `max_sessions` sessions
(one environment instance each, as create_app makes them); any other class one server per session at once (at
most MAX_SINGLE_SERVERS), since openenv serves it one session at a time. A server found dead is replaced (one log
line) before the next session; one that let an answer time out takes no new sessions and is stopped once its
sessions end.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sluiceway.infra.errors import UserError
from sluiceway.infra.prompt_sources import OPENENV, source_body, source_kind
from sluiceway.tasks.environments.openenv_client import CapacityReached, fetch_schema, http_url

log = logging.getLogger("sluiceway")
SERVE = Path(__file__).with_name("openenv_serve.py")
MAX_SINGLE_SERVERS = 8
START_TIMEOUT_S = 120.0


def openenv_python(flag: str = "--prompt-data") -> str:
    """The interpreter that serves environment classes (see the module docstring); a UserError if none."""
    env = os.environ.get("SLUICEWAY_OPENENV_PYTHON")
    if env:
        if not os.access(env, os.X_OK):
            raise UserError(f"SLUICEWAY_OPENENV_PYTHON={env}: not an executable")
        return env
    if importlib.util.find_spec("openenv") is not None:
        return sys.executable
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        p = root / ".venv-openenv" / "bin" / "python"
        if p.is_file():
            return str(p)
    raise UserError(
        f"{flag} openenv:MODULE:Class needs an interpreter with openenv 0.10: `make install` makes .venv-openenv "
        "in the checkout, or set SLUICEWAY_OPENENV_PYTHON to one (openenv cannot be installed beside verifiers)"
    )


def is_url(target: str) -> bool:
    return target.startswith(("http://", "https://", "ws://", "wss://"))


@functools.lru_cache(maxsize=16)
def check_target(target: str, python: str) -> dict:
    """Imports the class in the openenv interpreter: {"action": schema, "observation": schema, "concurrent"}, or a
    UserError with the serve script's one line."""
    try:
        p = subprocess.run([python, str(SERVE), "check", target], capture_output=True, text=True, timeout=120,
                           cwd=os.getcwd(), env=_child_env())  # fmt: skip
    except subprocess.TimeoutExpired:
        raise UserError(f"--prompt-data openenv:{target}: importing it took more than 120 s") from None
    for line in p.stdout.splitlines():
        if line.startswith("SCHEMA "):
            return json.loads(line[len("SCHEMA ") :])
        if line.startswith("ERROR "):
            raise UserError(f"--prompt-data openenv:{line[len('ERROR ') :]}")
    tail = (p.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
    raise UserError(f"--prompt-data openenv:{target}: {python} could not load it: {tail[:300]}")


def _child_env() -> dict:
    env = dict(os.environ)
    env["ENABLE_WEB_INTERFACE"] = "false"
    env.setdefault("NO_PROXY", "127.0.0.1,localhost")
    return env


class RemoteServer:
    """openenv:URL: every session connects to the one server (it holds as many as it allows: a session refused
    for capacity waits for a place, up to `wait_s`)."""

    def __init__(self, url: str, wait_s: float = 600.0):
        self.url = http_url(url)
        self.wait_s = wait_s

    @contextlib.asynccontextmanager
    async def session(self):
        yield self.url

    def hung(self, url: str) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class _Server:
    proc: subprocess.Popen
    url: str
    capacity: int
    stderr_path: str
    keep_log: bool = False
    active: int = 0
    retired: bool = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; a retired server (one that hung) at once: its stuck step would hold
        up its exit."""
        if self.proc.poll() is None and self.retired:
            self.proc.kill()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.keep_log:
            with contextlib.suppress(OSError):
                os.unlink(self.stderr_path)


class LocalServers:
    """openenv:MODULE:Class served on loopback (see the module docstring)."""

    def __init__(
        self, target: str, python: str, max_sessions: int, concurrent: bool | None, log_dir: str | None = None
    ):
        """`log_dir`: where each server's stderr is kept (openenv-server-N.log); None: a temporary file, removed
        with the server."""
        self.target, self.python, self.log_dir = target, python, log_dir
        self.concurrent = concurrent
        self.max_sessions = max(1, max_sessions)
        self.max_servers = 1 if concurrent or concurrent is None else min(self.max_sessions, MAX_SINGLE_SERVERS)
        # An app served as it is (concurrent None) holds what its author allowed: a session refused for capacity
        # waits for a place, as with a running server.
        self.wait_s = 600.0 if concurrent is None else 0.0
        self._servers: list[_Server] = []
        self._starting = 0
        self._lock = threading.Lock()
        self.started = 0  # servers started in all (a replaced one counts)

    # ----------------------------------------------------------------------- sessions
    @contextlib.asynccontextmanager
    async def session(self):
        server = await self._acquire()
        try:
            yield server.url
        finally:
            with self._lock:
                server.active -= 1
                stop = server.retired and server.active == 0
            if stop:
                await asyncio.to_thread(server.stop)

    def hung(self, url: str) -> None:
        with self._lock:
            for s in self._servers:
                if s.url == url and not s.retired:
                    s.retired = True
                    self._servers.remove(s)
                    log.warning(f"openenv:{self.target}: the server at {url} let an answer time out; new sessions "
                                "go to a new server")  # fmt: skip
                    if s.active == 0:
                        s.stop()
                    return

    async def _acquire(self) -> _Server:
        while True:
            with self._lock:
                for s in list(self._servers):
                    if not s.alive():
                        self._servers.remove(s)
                        log.warning(f"openenv:{self.target}: its server (pid {s.proc.pid}) exited with status "
                                    f"{s.proc.returncode}; starting another for the next session")  # fmt: skip
                for s in self._servers:
                    if s.active < s.capacity:
                        s.active += 1
                        return s
                start = len(self._servers) + self._starting < self.max_servers
                if start:
                    self._starting += 1
                    # numbered here, under the lock: two servers starting at once got the same number (and
                    # wrote their stderr into one file, the second truncating the first's)
                    self.started += 1
                    number = self.started
            if start:
                try:
                    s = await asyncio.to_thread(self._start, number)
                finally:
                    with self._lock:
                        self._starting -= 1
                with self._lock:
                    self._servers.append(s)
                    s.active += 1
                return s
            await asyncio.sleep(0.05)

    # ----------------------------------------------------------------------- processes
    def _start(self, number: int) -> _Server:
        """Start server `number` (1, 2, ... in the order they were asked for; a replaced one counts)."""
        from sluiceway.tasks.environments.openenv_client import EnvironmentFailed

        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            errpath = os.path.join(self.log_dir, f"openenv-server-{number}.log")
            fd = os.open(errpath, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        else:
            fd, errpath = tempfile.mkstemp(prefix="sluiceway-openenv-", suffix=".log")
        with os.fdopen(fd, "wb") as err:
            proc = subprocess.Popen(
                [self.python, str(SERVE), "serve", self.target, str(self.max_sessions)],
                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, cwd=os.getcwd(), env=_child_env(),
                start_new_session=True, text=True,
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        line = ""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if ready:
                line = proc.stdout.readline()
                if line.startswith(("PORT ", "ERROR ")) or not line:
                    break
            elif proc.poll() is not None:
                break
        if line.startswith("PORT "):
            parts = line.split()
            port, capacity = int(parts[1]), int(parts[3]) or self.max_sessions
            threading.Thread(target=_drain, args=(proc.stdout,), daemon=True).start()
            log.info(f"openenv:{self.target}: serving on 127.0.0.1:{port} (pid {proc.pid}, {capacity} session(s)"
                     f"{', its stderr in ' + errpath if self.log_dir else ''})")  # fmt: skip
            return _Server(proc, f"http://127.0.0.1:{port}", capacity, errpath, keep_log=bool(self.log_dir))
        proc.kill()
        proc.wait()
        why = line[len("ERROR ") :].strip() if line.startswith("ERROR ") else _tail(errpath) or "no answer"
        if not self.log_dir:
            with contextlib.suppress(OSError):
                os.unlink(errpath)
        raise EnvironmentFailed(f"the server for {self.target} did not start: {why[:300]}")

    def close(self) -> None:
        with self._lock:
            servers, self._servers = self._servers, []
        for s in servers:
            s.stop()


def _drain(stream) -> None:
    with contextlib.suppress(OSError, ValueError):
        for _ in stream:
            pass


def _tail(path: str) -> str:
    try:
        lines = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


# ------------------------------------------------------------------------------------------- the run's hooks
def parse_source(spec: str) -> str:
    if source_kind(spec) != OPENENV or not source_body(spec).strip():
        raise UserError(f"--prompt-data {spec}: expected openenv:URL or openenv:MODULE:Class")
    return source_body(spec).strip()


def check_openenv_source(spec: str) -> dict:
    """Preflight: the server answers /schema, or the class imports in the openenv interpreter and names its
    models. Returns the schemas."""
    target = parse_source(spec)
    if is_url(target):
        from sluiceway.tasks.environments.openenv_client import EnvironmentFailed

        try:
            return fetch_schema(target)
        except EnvironmentFailed as e:
            raise UserError(f"--prompt-data {spec}: {e}") from None
    if ":" not in target:
        raise UserError(f"--prompt-data {spec}: expected openenv:URL (http://...) or openenv:MODULE:Class")
    return check_target(target, openenv_python())


def openenv_generate(cfg):
    """The run's generate function for an openenv: --prompt-data (tasks/rollout/prompts.py)."""
    from sluiceway.tasks.environments.openenv_episode import EpisodeOptions, OpenEnvGenerate, load_user_function

    d, r = cfg.data, cfg.rollout
    spec = d.prompt_data
    if r.agent_function_path or r.custom_generate_function_path:
        raise UserError(f"--prompt-data {spec} plays the environment's episodes itself: it cannot be combined with "
                        "--agent-function-path or --custom-generate-function-path")  # fmt: skip
    schema = check_openenv_source(spec)
    target = parse_source(spec)
    sessions = min(
        r.rollout_max_concurrency, (r.over_sampling_batch_size or r.rollout_batch_size) * r.n_samples_per_prompt
    )
    servers = (
        RemoteServer(target)
        if is_url(target)
        else LocalServers(
            target,
            openenv_python(),
            sessions,
            None if schema.get("app") else bool(schema.get("concurrent")),
            log_dir=str(Path(cfg.storage.output_dir).expanduser() / "openenv"),
        )
    )
    options = EpisodeOptions(
        action_parser=load_user_function(d.openenv_action_parser, "--openenv-action-parser"),
        observation_text=load_user_function(d.openenv_observation_text, "--openenv-observation-text"),
        max_turns=d.openenv_max_turns, turn_tokens=d.openenv_turn_tokens, timeout_s=d.openenv_timeout_s,
        system_prompt=d.system_prompt,
    )  # fmt: skip
    return OpenEnvGenerate(servers, schema.get("action"), options)


__all__ = ["CapacityReached", "LocalServers", "RemoteServer", "check_openenv_source", "openenv_generate"]
