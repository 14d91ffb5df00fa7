"""Child processes that do not outlive the flow process that started them.

A flow killed with SIGKILL runs no cleanup, so engines, the router and the trainer group would linger, holding
ports and memory, and a resumed run would start a second set beside them. Linux's parent-death signal asks the
kernel to SIGTERM the child when its parent goes. The "parent" is the thread that spawned the child: sluiceway
starts these processes from the flow's main thread, which lives as long as the run.

Also the one place that picks free loopback ports for the processes it starts.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import re
import select
import signal
import socket
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
LOOPBACK = "127.0.0.1"


def die_with_parent() -> None:
    """`preexec_fn` for subprocess.Popen: SIGTERM this child when its parent dies (Linux; a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def free_port() -> int:
    """A loopback port free right now (the caller binds it soon; a lost race shows up as a start failure)."""
    return free_ports(1)[0]


def free_ports(n: int, with_offset: int = 0) -> list[int]:
    """``n`` distinct free loopback ports (the first also free at +with_offset).

    All sockets stay open until every port is chosen, so the kernel cannot hand out one twice.
    """
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind((LOOPBACK, 0))
            held.append(s)
            port = s.getsockname()[1]
            if with_offset and not ports:
                if port + with_offset > 65535:
                    continue
                try:
                    t = socket.socket()
                    t.bind((LOOPBACK, port + with_offset))
                except OSError:
                    t.close()
                    continue
                held.append(t)
            ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


def processes_with_env(name: str, value: str) -> list[int]:
    """Live (not zombie) processes whose environment holds ``name=value``: the children of a run tagged so,
    found even after they were re-parented (Linux /proc; an empty list elsewhere)."""
    found = []
    needle = f"{name}={value}\0".encode()
    if not os.path.isdir("/proc"):
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read() + b"\0":
                    with open(f"/proc/{entry}/stat") as s:
                        if s.read().split(")")[-1].split()[0] != "Z":
                            found.append(int(entry))
        except OSError:
            pass
    return found


def loopback_store(timeout_s: float = 300.0, world_size: int = 1):
    """A torch.distributed TCPStore server that listens on 127.0.0.1 only, on a port the OS picked.

    TCPStore's server listens on every interface whatever host it is given (`init_process_group(init_method=
    "tcp://127.0.0.1:PORT")`, torchrun's rendezvous): unauthenticated, reachable from the network. Binding the
    socket ourselves and handing its descriptor to the store keeps it on loopback; port 0 means two runs
    started at once cannot pick the same port. The port is the store's `.port`.
    """
    import datetime

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the descriptor from here on
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(LOOPBACK, port, world_size, True, timeout, master_listen_fd=fd)


def loopback_collectives() -> None:
    """Keep gloo's and NCCL's own sockets on loopback, unless the environment already names an interface.

    Gloo listens on the address the hostname resolves to (a LAN address on most machines) and NCCL's bootstrap
    on the first non-loopback interface; every trainer here runs on one machine and needs neither. Set before
    the process group is made; children (the ranks, engines) inherit it.
    """
    if sys.platform.startswith("linux"):
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(name, "lo")


# Environment variables a child process never needs: object-store and API credentials stay in the flow's
# process, which does all storage and reward-model calls (engines, router, trainer ranks and Prefect's server
# get none). A reward model's key variable has a user-chosen name: `register_secret_env` adds it.
_SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|API_?KEY|ACCESS_KEY|CREDENTIAL|AUTHKEY", re.I)
_SECRET_NAMES: set[str] = set()


def register_secret_env(name: str) -> None:
    _SECRET_NAMES.add(name)


def child_env(**extra: str) -> dict[str, str]:
    """os.environ without credentials, plus `extra` (which may hold what a child must have)."""
    env = {k: v for k, v in os.environ.items() if k not in _SECRET_NAMES and not _SECRET_NAME.search(k)}
    env.update(extra)
    return env


# --- SIGINT and SIGTERM: a run ends within seconds, whatever it was doing ------------------------------------
#
# Raising KeyboardInterrupt wherever the main thread happens to be (Python's default) is not a way to stop a run:
# inside an import it leaves a half-imported module that fails later with another error (networkx's dispatch
# registry: `KeyError: 'Algorithm already exists ...'`), inside a lock or a `finally` of Prefect's engine it can
# hang the exit, and in a C call (gloo, deltalake) it waits for the call. Stopping the children first and then
# exiting is not one either: for those seconds the flow's other threads see engines and ranks die and store what
# they make of it (a resume then trained on it: other weights than an uninterrupted run's).
#
# So the first signal ends the flow's process the way a SIGKILL would, which every stage already survives
# (docs/reliability.md), but in order: the terminal gets `interrupted` and nothing after it, a reaper process of
# its own is started with the process's descendants, the process exits 128 + the signal's number at once (every
# thread with it), and the reaper stops every process of the run: those descendants and every process whose
# environment carries the run's tag (engines, router, Prefect's server, the trainer group and their children),
# SIGTERM first, SIGKILL after TERM_GRACE_S.
#
# The work is done by a thread that waits on a pipe: the C-level signal handler writes the signal's number to it
# at once (signal.set_wakeup_fd), also while the main thread is in a long C call or under Prefect's own SIGTERM
# handler. The main thread, when it next runs Python code, writes it too and then waits to be ended, so it can
# neither raise in an import nor reach an exit of its own. The watchdog imports nothing and takes no lock the
# main thread may hold (no logging, no sys.stderr): it only makes system calls. At the end of a command that was
# not interrupted, the process exits with its code from the last atexit callback, before the interpreter's own
# teardown resets the handlers (a signal in those last moments killed it: exit -15, not 143).

RUN_TAG = "SLUICEWAY_RUN_PROCESS"  # in every child's environment: the run's processes, also once re-parented
FLOW_COMMANDS = ("run", "sft", "replay", "eval", "resume")  # the commands whose signals end them this way
TERM_GRACE_S = 3.0  # SIGTERM first (Prefect's server closes its database), SIGKILL whatever is left after this

# The reaper: `python -I -S -c _REAPER TAG GRACE_S PID:STARTTIME ...`, only the standard library's builtins.
_REAPER = r"""
import os, signal, sys, time
tag, grace = sys.argv[1], float(sys.argv[2])
known = dict(a.split(":") for a in sys.argv[3:])
me = str(os.getpid())
needle = ("SLUICEWAY_RUN_PROCESS=" + tag + "\0").encode()
def stat(pid):
    try:
        with open("/proc/" + pid + "/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
def ours(pid, fields):
    if known.get(pid) == fields[19].decode():
        return True
    try:
        with open("/proc/" + pid + "/environ", "rb") as f:
            return needle in f.read() + b"\0"
    except OSError:
        return False
def scan():
    found = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit() and pid != me:
            fields = stat(pid)
            if fields and fields[0] not in (b"Z", b"X") and ours(pid, fields):
                found[int(pid)] = int(fields[2])
    return found
def send(procs, sig):
    for pid, pgid in procs.items():
        try:
            if pgid == pid:
                os.killpg(pgid, sig)
            else:
                os.kill(pid, sig)
        except OSError:
            pass
def wait(procs, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any((f := stat(str(p))) and f[0] not in (b"Z", b"X") for p in procs):
            return
        time.sleep(0.05)
procs = scan()
send(procs, signal.SIGTERM)
wait(procs, grace)
for _ in range(2):
    procs = scan()
    if not procs:
        break
    send(procs, signal.SIGKILL)
    wait(procs, 1.0)
"""


class _Stopper:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.tag = f"{self.pid}-{os.urandom(6).hex()}"
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        # The terminal as it is now: later, fd 2 may be the run's log (flows/run.py send_native_stderr_to_log).
        self.terminal_fd = os.dup(2)
        self.terminal = {_identity(fd) for fd in (1, 2)} - {None}
        self.devnull = os.open(os.devnull, os.O_WRONLY)
        self.log_path: str | None = None
        self.signum = 0
        self.woken = False
        self.exit_code: int | None = None  # the command's, once `main` returned (flows/cli/main.py `entry`)
        self.thread = threading.Thread(target=self._watch, name="sluiceway-signals", daemon=True)

    def _watch(self) -> None:
        while True:
            # Readable first, read after: until `woken` is set the byte stays in the pipe, where `pending` sees it.
            select.select([self.read_fd], [], [])
            self.woken = True
            data = os.read(self.read_fd, 1)
            if data and os.getpid() == self.pid:
                self._stop(data[0])

    def pending(self) -> bool:
        """A signal arrived: the watchdog is (or is about to be) ending the process."""
        return self.woken or bool(select.select([self.read_fd], [], [], 0)[0])

    def on_signal(self, signum, frame) -> None:
        """The Python-level handler (main thread): hand over to the watchdog, then wait to be ended."""
        try:
            os.write(self.write_fd, bytes([signum]))
        except OSError:
            pass
        self.hold()

    def hold(self) -> None:
        while True:
            time.sleep(3600)

    def _stop(self, signum: int) -> None:
        self.signum = signum
        gc.disable()  # no finalizer runs in this thread (it could wait on a lock the main thread holds)
        self._silence_terminal()
        _write_all(self.terminal_fd, b"interrupted\n")
        code = 128 + signum
        name = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}.get(signum, str(signum))
        try:
            reaper = _start_reaper(self.tag, descendants(self.pid))
        except BaseException:  # noqa: BLE001 - no reaper (no memory, no process left): stop them from here
            reaper = None
        if reaper is None:
            self._log(f"interrupted by {name}: stopping the run's processes, then exit {code}")
            try:
                stop_processes(self.tag, TERM_GRACE_S)
            except BaseException:  # noqa: BLE001 - the exit below must happen whatever went wrong
                pass
        else:
            self._log(f"interrupted by {name}: exit {code}; process {reaper} stops the run's processes")
        os._exit(code)

    def _silence_terminal(self) -> None:
        """Everything written to the terminal from now on goes nowhere: `interrupted` is the last line."""
        fds = {1, 2}
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                fds.add(stream.fileno())
            except Exception:  # noqa: BLE001 - closed, replaced or absent
                pass
        for fd in fds:
            if _identity(fd) in self.terminal:
                try:
                    os.dup2(self.devnull, fd)
                except OSError:
                    pass

    def _log(self, message: str) -> None:
        if not self.log_path:
            return
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now % 1 * 1000):03d}"
        line = f"{stamp} sluiceway WARNING {message}\n".encode()
        try:
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError:
            return
        try:
            _write_all(fd, line)
        finally:
            os.close(fd)


# The process's one signal handling (signals are delivered to a process, not to a run): set by `exit_on_signals`.
_stopper: list[_Stopper] = []


def _identity(fd: int) -> tuple[int, int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_rdev)


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        pass


def _start_reaper(tag: str, known: dict[int, str]) -> int | None:
    """The reaper (`_REAPER`) in a session of its own, silent, given `known` (pid -> start time); its pid."""
    if not sys.platform.startswith("linux") or not sys.executable:
        return None
    devnull = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    args = [sys.executable, "-I", "-S", "-c", _REAPER, tag, str(TERM_GRACE_S)]
    args += [f"{pid}:{start}" for pid, start in known.items()]
    return os.posix_spawn(sys.executable, args, os.environ, file_actions=devnull, setsid=True)


def exit_on_signals(argv: list[str]) -> None:
    """For the `sluiceway` command: SIGINT and SIGTERM end the run as described above. Only for the flow commands
    (`FLOW_COMMANDS`, the first word of `argv`), from the main thread, once; anything else keeps Python's
    KeyboardInterrupt (the server, engine and pools commands stop their services on it)."""
    if _stopper or not argv or argv[0] not in FLOW_COMMANDS:
        return
    if threading.current_thread() is not threading.main_thread():
        return
    stopper = _Stopper()
    _stopper.append(stopper)
    os.environ[RUN_TAG] = stopper.tag  # every child started from here on carries it (child_env copies it)
    stopper.thread.start()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stopper.on_signal)
    signal.set_wakeup_fd(stopper.write_fd, warn_on_full_buffer=False)
    os.register_at_fork(after_in_child=_forget_in_child)
    atexit.register(_exit_with_the_code)  # registered first: runs last, after Prefect's and logging's


def _forget_in_child() -> None:
    """A forked child (multiprocessing's fork) is not the run: Python's defaults again, and not our pipe."""
    if not _stopper or os.getpid() == _stopper[0].pid:
        return
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):
        pass
    _stopper.clear()


def set_exit_code(code: int) -> None:
    """The command's exit code (flows/cli/main.py `entry`, before sys.exit): `_exit_with_the_code` ends with it."""
    if _stopper:
        _stopper[0].exit_code = code


def _exit_with_the_code() -> None:
    """The last atexit callback: every other one ran (Prefect's server stopped, the logs flushed); exit now with the
    command's code, while the handlers are still ours. What the interpreter's teardown would do next (reset the
    handlers, clear modules, flush stdio) can only lose a signal or fail the code (exit 120)."""
    if not _stopper or os.getpid() != _stopper[0].pid or _stopper[0].exit_code is None:
        return
    hold_if_stopping()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a full disk or a closed pipe: the code is the command's anyway
            pass
    hold_if_stopping()
    os._exit(_stopper[0].exit_code)


def stopping() -> bool:
    """True once a signal is ending this process (the watchdog is stopping the run's processes)."""
    return bool(_stopper) and _stopper[0].pending()


def hold_if_stopping() -> None:
    """Where the main thread would end the process (flows/cli/main.py `entry`): not while a signal is ending it, so
    the exit code is the signal's."""
    if stopping():
        _stopper[0].hold()


def note_run_log(path: str | os.PathLike) -> None:
    """The run's log file: the watchdog appends a line there saying the run was interrupted."""
    if _stopper:
        _stopper[0].log_path = os.fspath(path)


def _proc_table() -> dict[int, tuple[int, int, str, str]]:
    """pid -> (ppid, pgid, state, start time) of every process (Linux /proc; empty elsewhere)."""
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            table[int(entry)] = (int(fields[1]), int(fields[2]), fields[0].decode(), fields[19].decode())
        except (OSError, IndexError, ValueError):
            continue
    return table


def descendants(pid: int, table: dict | None = None) -> dict[int, str]:
    """Live descendants of `pid`: pid -> start time (which tells a pid reused meanwhile from the one seen)."""
    table = _proc_table() if table is None else table
    children: dict[int, list[int]] = {}
    for child, (ppid, _, _, _) in table.items():
        children.setdefault(ppid, []).append(child)
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and table[child][2] not in ("Z", "X"):
                found[child] = table[child][3]
                todo.append(child)
    return found


def run_processes(tag: str) -> dict[int, int]:
    """pid -> pgid of every live process of this run but this one: this process's descendants, and every process
    whose environment holds RUN_TAG=tag (the run's children once re-parented, their children)."""
    me = os.getpid()
    table = _proc_table()
    found = set(descendants(me, table)) | set(processes_with_env(RUN_TAG, tag))
    found.discard(me)
    return {pid: table[pid][1] for pid in found if pid in table and table[pid][2] not in ("Z", "X")}


def _signal_all(procs: dict[int, int], sig: int) -> None:
    own_group = os.getpgid(0)
    for pid, pgid in procs.items():
        try:
            if pgid == pid and pgid != own_group:  # a group leader (start_new_session): its whole group
                os.killpg(pgid, sig)
            else:
                os.kill(pid, sig)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def stop_processes(tag: str, grace_s: float = TERM_GRACE_S) -> None:
    """From this process (when no reaper could be started): SIGTERM every process of the run
    (`run_processes`), SIGKILL what is left after `grace_s` (and what was started meanwhile), and wait a moment
    for them to go."""
    procs = run_processes(tag)
    _signal_all(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in procs):
        time.sleep(0.05)
    for _ in range(2):  # twice: a process may have started one more before it died
        procs = run_processes(tag)
        if not procs:
            return
        _signal_all(procs, signal.SIGKILL)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(_alive(p) for p in procs):
            time.sleep(0.02)
