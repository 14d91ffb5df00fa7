"""Run untrusted Python (model-written code) in a throw-away, resource-capped, network-less sandbox.

``run_sandboxed(code, stdin=...)`` never raises: every outcome, including a broken sandbox, is a
:class:`SandboxResult` whose ``status`` is one of ``ok | error | timeout | memory | output_limit | killed``.

How a run is isolated (the default, ``isolation="namespace"``; needs root, i.e. CAP_SYS_ADMIN):

* ``unshare --net --pid --fork --kill-child --mount --mount-proc`` starts a small launcher (our code, as
  root) as PID 1 of fresh network, PID and mount namespaces, in a new session/process group of its own.
* **Network**: the new network namespace has only a loopback device, and it is down: every connect, to
  127.0.0.1 or to the internet, fails with ENETUNREACH. Nothing can leave the machine or reach host services.
* **Filesystem**: inside the mount namespace (propagation made private first, so nothing leaks back to the
  host) the launcher mounts a size-capped tmpfs (``disk_mb``) on the run's working directory, then remounts
  *every other mount* read-only (bind remounts: per-mount flags only, the host's mounts are untouched).
  The code therefore can write nowhere but its own tmpfs, which disappears with the namespace. The Python
  installation is bind-mounted read-only next to the working directory, so the interpreter is usable even
  when it lives under an unreadable home directory (``/root/.pyenv``).
* **Privileges**: the user code runs as a fresh unprivileged uid/gid (random in 1,000,000-1,999,999, no
  supplementary groups, ``no_new_privs`` so setuid binaries cannot regain root). It cannot read files that
  are not world-readable, cannot signal or ptrace host processes, and sees only its own PID namespace.
* **Processes**: ``RLIMIT_NPROC = max_processes`` is enforced because the uid is not root and (being
  fresh per run) its count starts at ~1; note it counts threads too. When the code's main process ends, the
  launcher (PID 1) exits and the kernel kills everything left in the PID namespace; on timeout the host side
  ``killpg(SIGKILL)``s the whole process group, and ``--kill-child`` (PDEATHSIG) plus PID-namespace teardown
  take down descendants that called ``setsid()``. A fork bomb thus hits EAGAIN at ``max_processes`` and is
  reaped at the deadline.
* **CPU / memory / files**: ``RLIMIT_CPU`` (about ``timeout_s``; SIGXCPU), ``RLIMIT_AS = memory_mb``
  (a hog gets ``MemoryError``), ``RLIMIT_FSIZE`` (``max_file_mb``), ``RLIMIT_NOFILE``, ``RLIMIT_CORE = 0``.
* **Wall clock / output**: the host reads stdout+stderr itself; past ``timeout_s`` or past
  ``max_output_bytes`` (stdout+stderr together) it kills the process group. Reads never block past the deadline.
* The interpreter runs as ``python -I -S -B``: no site-packages, no PYTHON* variables, no user site; the
  environment is minimal (``HOME=TMPDIR=cwd=`` the working directory).

What is NOT enforced / known limits (the threat model): this is defence in depth against buggy or
reward-hacking code, not a hardened jail against kernel exploits. There is no seccomp filter, so the whole
syscall surface of the host kernel is reachable; no cgroup is used, so RSS is bounded only via address space
(``RLIMIT_AS``) and the tmpfs size, and CPU *share* is not capped (a run may use a whole core until its
limits fire). World-readable host files (``/etc/passwd``, the project's code, world-readable data) can be
*read*. Uid collisions between concurrent runs (1 in a million) would only make them share the process cap.
Anything the code prints is untrusted; graders (``code_exec``) must treat in-process results as forgeable.

Fallback (``isolation="degraded"``, only when asked with ``allow_degraded=True`` and namespaces are not
available): rlimits + new session + throw-away cwd + (when root) a drop to an unprivileged uid, plus an audit
hook that refuses ``socket.connect``/``bind``/``sendto``, ``subprocess``/``os.exec*``/``os.system`` in the
child. An audit hook is NOT a security boundary (ctypes can bypass it); ``result.isolation`` says which mode
ran and ``reason`` mentions it. Without ``allow_degraded`` the sandbox refuses to run code it cannot isolate.
"""

from __future__ import annotations

import json
import math
import os
import random
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed")
UID_RANGE = (1_000_000, 1_999_999)


@dataclass
class SandboxResult:
    status: str
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    reason: str = ""
    wall_s: float = 0.0
    isolation: str = "none"  # "namespace" | "degraded" | "none" (did not run)
    pgid: int | None = None  # the run's process group on the host; gone once run_sandboxed returns
    details: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ---------------------------------------------------------------------------------------------------------
# The launcher: runs as root, PID 1 of the new namespaces. Kept to the stdlib (it runs under -I -S).
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
sfd = cfg["status_fd"]
os.set_inheritable(sfd, False)

def report(msg):
    try:
        os.write(sfd, (msg + "\n").encode())
    except OSError:
        pass

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
KEEP = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
        "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

def mount(src, tgt, fs, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(tgt), enc(fs), flags, enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, "mount %s: %s" % (tgt, os.strerror(e)))

def unescape(s):
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")

try:
    uid, work = cfg["uid"], cfg["work"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV,
          "size=%dk,mode=0700,uid=%d,gid=%d" % (cfg["disk_kb"], uid, uid))
    with open(cfg["code_path"], "rb") as f:
        code = f.read()
    main = os.path.join(work, "main.py")
    with open(main, "wb") as f:
        f.write(code)
    os.chown(main, uid, uid)
    mount(cfg["py_root"], cfg["py_mnt"], None, MS_BIND | MS_REC)
    failed = []
    with open("/proc/self/mountinfo") as f:
        mounts = [(unescape(l.split()[4]), l.split()[5].split(",")) for l in f]
    for mp, opts in mounts:
        if mp == work:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for o in opts:
            flags |= KEEP.get(o, 0)
        try:
            mount(None, mp, None, flags)
        except OSError as e:
            failed.append(mp)
    if "/" in failed:
        raise OSError("could not make / read-only")
    if failed:
        report("note read-only remount failed for " + ",".join(sorted(set(failed))))
except BaseException as e:
    report("setup %s: %s" % (type(e).__name__, e))
    os._exit(125)

pid = os.fork()
if pid == 0:
    try:
        R = resource
        for lim, val in ((R.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1)), (R.RLIMIT_AS, cfg["as_bytes"]),
                         (R.RLIMIT_NPROC, cfg["nproc"]), (R.RLIMIT_FSIZE, cfg["fsize"]),
                         (R.RLIMIT_NOFILE, 256), (R.RLIMIT_CORE, 0)):
            resource.setrlimit(lim, val if isinstance(val, tuple) else (val, val))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            raise OSError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS)")
        os.chdir(work)
        exe = cfg["exe"]
        os.execve(exe, [exe, "-I", "-S", "-B", "main.py"] + cfg["argv"], cfg["env"])
    except BaseException as e:
        report("setup %s: %s" % (type(e).__name__, e))
        os._exit(125)

while True:  # PID 1: reap everything, report the main child's end, then exit (the kernel kills the rest)
    try:
        p, st = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    except InterruptedError:
        continue
    if p == pid:
        if os.WIFSIGNALED(st):
            report("signal %d" % os.WTERMSIG(st))
        else:
            report("exit %d" % os.WEXITSTATUS(st))
        break
os._exit(0)
"""

# The degraded mode's prelude: an audit hook (best effort, NOT a boundary), then the user's main.py.
_PRELUDE = r"""
import sys
_BLOCK = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "subprocess.Popen",
          "os.system", "os.exec", "os.posix_spawn", "os.spawn", "pty.spawn", "ctypes.dlopen")
def _hook(ev, args, _b=_BLOCK):
    if ev.startswith(_b):
        raise PermissionError("sandbox: %s is not allowed" % ev)
sys.addaudithook(_hook)
del _hook
__file__ = "main.py"
exec(compile(open("main.py", "rb").read(), "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py"})
"""

# Whether this machine lets the sandbox make namespaces, probed once per process: a fact of the machine, not of a run.
_NS_PROBE: tuple[bool, str] | None = None
_NS_LOCK = threading.Lock()
_UNSHARE_ARGS = ["--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc"]


def _traversable_tmp() -> str | None:
    """A temporary directory the sandbox's unprivileged uid can reach: the system's, unless a parent of it may not
    be traversed by others (a private TMPDIR, 0700), then /tmp (a fresh machine's `make test` found this: every
    sandboxed run failed to start under a private TMPDIR). None: tempfile's choice, if nothing better exists."""
    base = Path(tempfile.gettempdir()).resolve()
    for candidate in (base, Path("/tmp")):
        if all(p.stat().st_mode & stat.S_IXOTH for p in (candidate, *candidate.parents) if p.exists()):
            return str(candidate)
    return None


def namespaces_available() -> tuple[bool, str]:
    """Whether ``unshare`` can create net+pid+mount namespaces here (probed once, cached)."""
    global _NS_PROBE
    with _NS_LOCK:
        if _NS_PROBE is None:
            unshare = shutil.which("unshare")
            if unshare is None:
                _NS_PROBE = (False, "unshare(1) not found")
            elif os.geteuid() != 0:
                _NS_PROBE = (False, "not root: cannot create network/mount namespaces")
            else:
                try:
                    p = subprocess.run([unshare, *_UNSHARE_ARGS, "true"], capture_output=True, timeout=10)
                    ok = p.returncode == 0
                    _NS_PROBE = (ok, "" if ok else f"unshare failed: {p.stderr.decode(errors='replace')[:200]}")
                except Exception as e:  # noqa: BLE001
                    _NS_PROBE = (False, f"unshare failed: {type(e).__name__}: {e}")
        return _NS_PROBE


def _python() -> tuple[str, str]:
    """(real interpreter path, its installation prefix)."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    return exe, prefix


def _others_can_run(path: str) -> bool:
    """Whether a uid with no special rights can traverse to and execute ``path`` (mode bits only)."""
    parts = os.path.realpath(path).split(os.sep)
    for i in range(2, len(parts)):
        if not os.stat(os.sep.join(parts[:i]) or os.sep).st_mode & 0o001:
            return False
    return bool(os.stat(path).st_mode & 0o005 == 0o005)


def _min_env(work: str, extra: dict | None = None) -> dict:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    env.update(extra or {})
    return env


def _feed_stdin(pipe, data: bytes) -> None:
    try:
        if data:
            pipe.write(data)
    except (BrokenPipeError, OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except (BrokenPipeError, OSError, ValueError):
            pass


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap_group(pgid: int, wait_s: float = 5.0) -> bool:
    """SIGKILL the process group until it is empty (SIGKILL is asynchronous); True when it is gone."""
    end = time.monotonic() + wait_s
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        if time.monotonic() > end:
            return False
        time.sleep(0.005)


def run_sandboxed(
    code: str,
    stdin: str = "",
    timeout_s: float = 5,
    memory_mb: int = 256,
    max_output_bytes: int = 64_000,
    max_processes: int = 32,
    language: str = "python",
    *,
    argv: list[str] | None = None,
    disk_mb: int = 64,
    max_file_mb: int = 16,
    allow_degraded: bool = False,
    isolation: str = "auto",
) -> SandboxResult:
    """Run ``code`` (a Python program) sandboxed; see the module docstring for what is enforced.

    ``isolation``: "auto" (namespaces, else degraded if ``allow_degraded``, else refuse), "namespace", or
    "degraded" (testing the fallback). Never raises.
    """
    t0 = time.monotonic()
    try:
        return _run(
            code,
            stdin,
            timeout_s,
            memory_mb,
            max_output_bytes,
            max_processes,
            language,
            argv or [],
            disk_mb,
            max_file_mb,
            allow_degraded,
            isolation,
            t0,
        )
    except Exception as e:  # noqa: BLE001 - the contract: only SandboxResult comes out
        return SandboxResult("error", None, "", "", f"sandbox failure: {type(e).__name__}: {e}", time.monotonic() - t0)


def _run(
    code,
    stdin,
    timeout_s,
    memory_mb,
    max_output_bytes,
    max_processes,
    language,
    argv,
    disk_mb,
    max_file_mb,
    allow_degraded,
    isolation,
    t0,
) -> SandboxResult:
    if language != "python":
        return SandboxResult("error", reason=f"unsupported language {language!r} (only python)")
    if isolation not in ("auto", "namespace", "degraded"):
        return SandboxResult("error", reason=f"unknown isolation {isolation!r}")
    ns_ok, ns_why = namespaces_available()
    if isolation == "auto":
        isolation = "namespace" if ns_ok else "degraded"
    if isolation == "namespace" and not ns_ok:
        return SandboxResult("error", reason=f"sandbox unavailable: {ns_why}", wall_s=time.monotonic() - t0)
    if isolation == "degraded" and not allow_degraded:
        why = ns_why or "degraded isolation requested"
        return SandboxResult("error", reason=f"sandbox unavailable ({why}); allow_degraded=False")

    exe, prefix = _python()
    uid = random.randint(*UID_RANGE)
    cpu_s = max(1, math.ceil(timeout_s))
    limits = {
        "cpu_s": cpu_s,
        "as_bytes": int(memory_mb) << 20,
        "nproc": int(max_processes),
        "fsize": int(max_file_mb) << 20,
    }
    outer = tempfile.mkdtemp(prefix="sluiceway_sandbox_", dir=_traversable_tmp())
    status_r = status_w = None
    proc = None
    try:
        os.chmod(outer, 0o711)
        work = os.path.join(outer, "work")
        os.mkdir(work, 0o700)
        if isolation == "namespace":
            py_mnt = os.path.join(outer, "py")
            os.mkdir(py_mnt, 0o755)
            code_path = os.path.join(outer, "code.py")
            with open(code_path, "w", encoding="utf-8") as f:
                f.write(code)
            os.chmod(code_path, 0o600)
            rel = os.path.relpath(exe, prefix)
            sandbox_exe = os.path.join(py_mnt, rel) if not rel.startswith("..") else exe
            cfg = {
                "uid": uid,
                "work": work,
                "disk_kb": int(disk_mb) * 1024,
                "code_path": code_path,
                "py_root": prefix,
                "py_mnt": py_mnt,
                "exe": sandbox_exe,
                "argv": list(argv),
                "env": _min_env(work, {"LD_LIBRARY_PATH": os.path.join(py_mnt, "lib")}),
                **limits,
            }
            status_r, status_w = os.pipe()
            cfg["status_fd"] = status_w
            cmd = [shutil.which("unshare"), *_UNSHARE_ARGS, exe, "-I", "-S", "-B", "-c", _LAUNCHER, json.dumps(cfg)]
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=outer,
                env=_min_env(outer),
                start_new_session=True,
                close_fds=True,
                pass_fds=(status_w,),
            )
            os.close(status_w)
            status_w = None
        else:
            with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            drop = os.geteuid() == 0
            if drop and not _others_can_run(exe):
                return SandboxResult(
                    "error",
                    reason=f"sandbox unavailable: {exe} is not executable by an unprivileged uid "
                    "(degraded mode will not run code as root)",
                    wall_s=time.monotonic() - t0,
                    isolation="degraded",
                )
            if drop:
                os.chown(work, uid, uid)
                os.chown(os.path.join(work, "main.py"), uid, uid)

            def preexec():  # runs in the child between fork and exec
                import resource as R

                R.setrlimit(R.RLIMIT_CPU, (cpu_s, cpu_s + 1))
                R.setrlimit(R.RLIMIT_AS, (limits["as_bytes"],) * 2)
                R.setrlimit(R.RLIMIT_FSIZE, (limits["fsize"],) * 2)
                R.setrlimit(R.RLIMIT_NOFILE, (256, 256))
                R.setrlimit(R.RLIMIT_CORE, (0, 0))
                if drop:
                    R.setrlimit(R.RLIMIT_NPROC, (max_processes,) * 2)
                    os.setgroups([])
                    os.setgid(uid)
                    os.setuid(uid)

            proc = subprocess.Popen(
                [exe, "-I", "-S", "-B", "-c", _PRELUDE, *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=work,
                env=_min_env(work),
                start_new_session=True,
                close_fds=True,
                preexec_fn=preexec,
            )
        res = _supervise(proc, stdin, timeout_s, max_output_bytes, status_r, isolation, ns_why, memory_mb, t0)
        res.details["uid"] = uid
        return res
    finally:
        for fd in (status_r, status_w):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        if proc is not None:
            _killpg(proc.pid)
            if proc.poll() is None:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            _reap_group(proc.pid)
        shutil.rmtree(outer, ignore_errors=True)


def _supervise(proc, stdin, timeout_s, max_output_bytes, status_r, isolation, ns_why, memory_mb, t0) -> SandboxResult:
    pgid = proc.pid  # start_new_session: the child leads its own process group
    deadline = t0 + timeout_s
    feeder = threading.Thread(target=_feed_stdin, args=(proc.stdin, stdin.encode()), daemon=True)
    feeder.start()
    sel = selectors.DefaultSelector()
    bufs = {"stdout": bytearray(), "stderr": bytearray()}
    for name in bufs:
        pipe = getattr(proc, name)
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe, selectors.EVENT_READ, name)
    if status_r is not None:
        sel.register(status_r, selectors.EVENT_READ, "status")
    status_buf = bytearray()
    killed_for = None
    total = 0
    while sel.get_map():  # until stdout, stderr and the status pipe are all closed (everything has exited)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            killed_for = "timeout"
            break
        events = sel.select(timeout=min(remaining, 0.5))
        for key, _ in events:
            fd = key.fd if key.data == "status" else key.fileobj.fileno()
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            if key.data == "status":
                status_buf += chunk
                continue
            room = max_output_bytes - total
            bufs[key.data] += chunk[: max(room, 0)]
            total += len(chunk)
            if total > max_output_bytes:
                killed_for = "output_limit"
                break
        if killed_for:
            break
    if killed_for:
        _killpg(pgid)
    try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()) if not killed_for else 5)
    except subprocess.TimeoutExpired:
        killed_for = killed_for or "timeout"
        _killpg(pgid)
        proc.wait(timeout=5)
    # drain what is left of the status pipe (non-blocking: the writers are gone now)
    if status_r is not None:
        try:
            os.set_blocking(status_r, False)
            while chunk := os.read(status_r, 65536):
                status_buf += chunk
        except OSError:
            pass
    sel.close()
    _killpg(pgid)
    wall = time.monotonic() - t0
    out = bufs["stdout"].decode("utf-8", errors="replace")
    err = bufs["stderr"].decode("utf-8", errors="replace")
    res = SandboxResult("ok", None, out, err, "", wall, isolation, pgid)
    notes = []
    if isolation == "degraded":
        notes.append(f"degraded isolation ({ns_why or 'requested'}): network blocked only by an audit hook")
    rc, sig, setup_err = proc.returncode, None, None
    if status_r is not None:  # the launcher's report is authoritative about the user's process
        rc = None
        for line in status_buf.decode(errors="replace").splitlines():
            kind, _, val = line.partition(" ")
            if kind == "exit":
                rc = int(val)
            elif kind == "signal":
                sig = int(val)
            elif kind == "setup":
                setup_err = val
            elif kind == "note":
                notes.append(val)
    elif rc is not None and rc < 0:
        sig, rc = -rc, None
    res.details = {"output_bytes": total, "signal": sig}
    if killed_for == "timeout":
        res.status, res.reason = "timeout", f"wall-clock timeout after {timeout_s}s (process group killed)"
    elif killed_for == "output_limit":
        res.status, res.reason = "output_limit", f"output exceeded {max_output_bytes} bytes (process group killed)"
    elif setup_err:
        res.status, res.reason = "error", f"sandbox setup failed: {setup_err}"
    elif sig is not None:
        res.returncode = -sig
        if sig == signal.SIGXCPU:
            res.status, res.reason = "timeout", "CPU time limit exceeded (SIGXCPU)"
        elif sig == signal.SIGXFSZ:
            res.status, res.reason = "error", "file size limit exceeded (SIGXFSZ)"
        else:
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            res.status, res.reason = "killed", f"killed by signal {name} (may be the {memory_mb} MB memory limit)"
    elif rc is None:
        res.status, res.reason = "killed", "the sandboxed process ended without an exit status"
    else:
        res.returncode = rc
        tail = err[-4000:]
        if rc == 0:
            res.status = "ok"
        elif "MemoryError" in tail or "Cannot allocate memory" in tail:
            res.status, res.reason = "memory", f"memory limit ({memory_mb} MB address space) exceeded"
        else:
            last = next((ln for ln in reversed(tail.strip().splitlines()) if ln.strip()), "")
            res.status, res.reason = "error", f"exit code {rc}" + (f": {last[:300]}" if last else "")
    if notes:
        res.reason = "; ".join([r for r in [res.reason, *notes] if r])
    if res.returncode is None and killed_for is None and proc.returncode is not None and status_r is None:
        res.returncode = proc.returncode
    if res.status not in STATUSES:  # pragma: no cover - defensive
        res.status = "error"
    return res
