"""A separate-process harness (a coding agent, a CLI) run for one session, where other harnesses cannot read its key.

A harness that is its own program learns its session from its environment (`OPENAI_API_KEY`, ...: `agent_env`),
and a process's environment is readable by every other process of the same user (`/proc/PID/environ`): started
with plain `subprocess`, one session's harness (model-driven code) can read every other live session's key and
post their rewards. `run_harness` starts it instead in namespaces of its own (util-linux `unshare`):

* a **user namespace** in which it runs as an ordinary uid without capabilities, mapped to the run's user (so it
  reads and writes what the run's user can: its files, its checkout, its HOME);
* a **PID namespace** with its own `/proc`: it sees only its own processes; other sessions' harnesses, the run
  and its engines have no PID it can name, and without capabilities it cannot unmount that `/proc` (nor, from a
  namespace it makes itself, separate it from what lies under: the kernel locks inherited mounts);
* a small init as PID 1 that starts the command, passes signals on, reaps orphans, and exits with its status;
  when it exits the kernel ends whatever the harness left running.

The network and the filesystem are shared (the harness reaches the endpoint on 127.0.0.1 as before); this is
key isolation between sessions, not a sandbox (model-written code that must not touch files or the network
belongs in tasks/reward/sandbox.py). What still reads a harness's environment: processes outside its namespaces
running as the same user (your shell, the run itself), and root's. docs/agents.md says the same.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

from sluiceway.infra.proc import child_env
from sluiceway.tasks.rollout.agent.proxy import agent_env

__all__ = ["HarnessIsolationError", "harness_command", "harness_env", "isolation_available", "run_harness"]

# PID 1 of the harness's namespace. The kernel delivers to a namespace's init only the signals it handles, and
# orphans are re-parented to it: so the command runs as its child, with Python's ignored SIGPIPE/SIGXFSZ put back.
_INIT = r"""
import os, signal, sys
cmd = sys.argv[1:]
pid = os.fork()
if pid == 0:
    for s in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
        signal.signal(s, signal.SIG_DFL)
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        os.write(2, f"cannot run {cmd[0]}: {e.strerror}\n".encode())
        os._exit(127)
def forward(sig, frame):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(s, forward)
while True:
    wpid, status = os.wait()
    if wpid == pid:
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
"""


class HarnessIsolationError(RuntimeError):
    """The harness cannot be started in namespaces of its own here (the reason says why)."""


def _inner_ids() -> tuple[int, int]:
    """The uid/gid the harness has inside its user namespace: the run's own, unless that is root, whose
    capabilities in the namespace would let the harness unmount its /proc; then an ordinary one."""
    uid, gid = os.getuid(), os.getgid()
    return (uid or 1000, gid or 1000)


def _unshare_args() -> list[str]:
    unshare = shutil.which("unshare")
    if unshare is None:
        raise HarnessIsolationError("unshare(1) (util-linux) is not installed")
    uid, gid = _inner_ids()
    return [unshare, "--user", f"--map-user={uid}", f"--map-group={gid}", "--pid", "--fork", "--kill-child",
            "--mount-proc"]  # fmt: skip


@functools.cache
def isolation_available() -> tuple[bool, str]:
    """Whether this machine lets `run_harness` isolate (user and PID namespaces), and if not why. A fact of the
    machine and kernel, probed once per process (about 10 ms)."""
    try:
        proc = subprocess.run([*_unshare_args(), "true"], capture_output=True, text=True, timeout=30)
    except HarnessIsolationError as exc:
        return False, str(exc)
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"unshare failed: {exc}"
    if proc.returncode != 0:
        return False, f"unshare failed: {proc.stderr.strip()[:200] or f'exit {proc.returncode}'}"
    return True, ""


def harness_command(cmd: Sequence[str]) -> list[str]:
    """`cmd` as it runs isolated: for asyncio or Popen (`asyncio.create_subprocess_exec(*harness_command(cmd),
    env=harness_env(...))`). Raises HarnessIsolationError where namespaces cannot be made."""
    ok, why = isolation_available()
    if not ok:
        raise HarnessIsolationError(
            f"cannot isolate the harness ({why}); run_harness(..., isolate=False) runs it without, where any "
            "process of this user can read its key"
        )
    return [*_unshare_args(), "--", sys.executable, "-I", "-S", "-c", _INIT, *cmd]


def harness_env(base_url: str, api_key: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The run's environment without its credentials (storage keys, tokens: infra/proc.py `child_env`), with the
    session's client settings (`agent_env`) and `extra` on top."""
    env = child_env(**agent_env(base_url, api_key))
    env.update(extra or {})
    return env


def run_harness(
    cmd: Sequence[str],
    base_url: str,
    api_key: str,
    *,
    input: str | None = None,
    timeout: float | None = 600.0,
    cwd: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    isolate: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run a harness program for one session and wait for it, as `subprocess.run(cmd, input=input,
    capture_output=True, text=True, timeout=timeout)` does (past `timeout` its whole namespace is killed and
    TimeoutExpired raised). Its environment is `harness_env(base_url, api_key, env)`.

    `isolate=False` runs it as a plain child (then every process of this user can read its key); where
    namespaces cannot be made and `isolate` is True, HarnessIsolationError says why, before anything starts."""
    argv = harness_command(cmd) if isolate else list(cmd)
    stdin = subprocess.DEVNULL if input is None else None  # not the run's terminal
    return subprocess.run(argv, input=input, stdin=stdin, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=harness_env(base_url, api_key, env))  # fmt: skip
