"""One live process per run: a lock on the run directory and a lease on the run's tables in the object store.

Two runs writing one run directory or one run's tables mix their rows and weights (issue 20), so a command that
writes a run takes both before it starts anything, and a second one is refused with one line naming the holder.

- The run directory: `flock` on OUTPUT_DIR/.sluiceway.lock. The kernel drops it when the holder dies, however it
  dies, so a resume right after a kill never waits. The file holds the holder's pid, host and start time.
- The tables (local or S3): a lease under STORE/_leases/RUN_ID/, generation files `gNNNNNNNN.json` created with
  an exclusive create (an S3 conditional PUT, `If-None-Match: *`, which deltalake relies on too), so of two
  processes taking generation N+1 exactly one wins. The holder rewrites `gNNNNNNNN.beat` every `ttl/4` seconds.
  A lease is free when its holder released it, when its beat is older than `ttl`, or when its holder ran on this
  host and its process is gone. A holder that finds a newer generation (it was taken over after it stopped
  beating: a paused VM, a lost network) or cannot beat for `ttl` has lost the lease: `ensure_held` raises, and
  every stage calls it before it writes (flows/live_run.py `live`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import functools
import json
import logging
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from sluiceway.infra.errors import Fault, UserError
from sluiceway.storage.object_store import ObjectStore

log = logging.getLogger("sluiceway")

LOCK_FILE = ".sluiceway.lock"
# Longer than the stages' default retry budget (retry_budget_s in flows/config/, 90 s): a run riding out an object
# store outage cannot beat meanwhile, and must not lose its lease before its retries give up.
LEASE_TTL_S = 150.0


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot): tells a live holder from a reused pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@dataclass
class Holder:
    pid: int
    host: str
    since: str  # ISO time the lock was taken
    command: str
    start: str | None  # _process_start(pid)

    @classmethod
    def me(cls, command: str) -> Holder:
        now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        return cls(os.getpid(), socket.gethostname(), now, command, _process_start(os.getpid()))

    def describe(self) -> str:
        return f"`sluiceway {self.command}` (pid {self.pid} on {self.host}, since {self.since})"

    def dead_here(self) -> bool:
        """Ran on this host and its process is gone (or the pid now belongs to another process)."""
        return self.host == socket.gethostname() and _process_start(self.pid) != self.start


def _read_holder(text: str) -> Holder | None:
    try:
        return Holder(**json.loads(text))
    except (ValueError, TypeError):
        return None


class _Lease:
    """The store half: generations and beats under STORE/_leases/RUN_ID (module docstring)."""

    def __init__(self, store: ObjectStore, run_id: str, ttl_s: float):
        self.store, self.ttl_s, self.fs = store, ttl_s, store.filesystem()
        self.base = store.join("_leases", run_id).removeprefix("s3://")
        self.gen: int | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_beat = 0.0

    def _path(self, gen: int, ext: str) -> str:
        return f"{self.base}/g{gen:08d}.{ext}"

    def _newest(self) -> int | None:
        self.fs.invalidate_cache(self.base)
        try:
            names = self.fs.ls(self.base, detail=False)
        except FileNotFoundError:
            return None
        gens = [int(n.rsplit("/", 1)[-1][1:9]) for n in names if n.endswith(".json")]
        return max(gens, default=None)

    def _read(self, path: str) -> str | None:
        try:
            self.fs.invalidate_cache(path)
            with self.fs.open(path, "r") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _busy(self, gen: int) -> Holder | None:
        """The live holder of generation `gen`, or None when that lease is free to take over."""
        holder = _read_holder(self._read(self._path(gen, "json")) or "")
        beat = json.loads(self._read(self._path(gen, "beat")) or "{}")
        if holder is None or beat.get("released"):
            return None
        if holder.dead_here():  # a killed run on this host: taking its lease over is the expected resume
            log.debug("taking over the lease of %s: its process is gone", holder.describe())
            return None
        if time.time() - float(beat.get("at", 0)) > self.ttl_s:
            log.warning("taking over the lease of %s: it stopped beating", holder.describe())
            return None
        return holder

    def acquire(self, me: Holder) -> None:
        with self.store.redacting():
            if not self.store.is_s3:
                Path(self.base).mkdir(parents=True, exist_ok=True)
            newest = self._newest()
            if newest is not None and (holder := self._busy(newest)) is not None:
                raise UserError(f"run tables {self.store.join('_leases')}: held by {holder.describe()}")
            gen = 0 if newest is None else newest + 1
            body = json.dumps(me.__dict__).encode()
            try:
                if self.store.is_s3:
                    self.fs.pipe_file(self._path(gen, "json"), body, mode="create")
                else:
                    fd = os.open(self._path(gen, "json"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    with os.fdopen(fd, "wb") as f:
                        f.write(body)
            except OSError as e:  # s3fs maps S3's 412 PreconditionFailed to OSError(EINVAL)
                if not (isinstance(e, FileExistsError) or e.errno == errno.EINVAL or "Precondition" in str(e)):
                    raise
                raise UserError(
                    f"run tables {self.store.join('_leases')}: another process took the lease at the same moment"
                ) from None
            self.gen = gen
            self._beat()
            for old in range(max(0, gen - 8), gen):  # earlier holders' files: only the newest one counts
                for ext in ("json", "beat"):
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm_file(self._path(old, ext))
        self._thread = threading.Thread(target=self._heartbeat, name="sluiceway-lease", daemon=True)
        self._thread.start()

    def _beat(self, released: bool = False) -> None:
        self.fs.pipe_file(self._path(self.gen, "beat"), json.dumps({"at": time.time(), "released": released}).encode())
        self._last_beat = time.monotonic()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                with self.store.redacting():
                    newest = self._newest()
                    if newest is not None and newest > self.gen:
                        self.lost = f"another process took over the run's lease (generation {newest})"
                        return
                    self._beat()
            except Exception as e:  # noqa: BLE001 - the store may be down for a while; the lease may outlive it
                log.warning("run lease heartbeat failed: %s", str(e).splitlines()[0] if str(e) else e)
                if time.monotonic() - self._last_beat > self.ttl_s:
                    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    self.lost = f"the object store did not answer for {self.ttl_s:.0f} s ({first}): the lease lapsed"
                    return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.gen is not None and self.lost is None:
            with contextlib.suppress(Exception), self.store.redacting():
                self._beat(released=True)


class RunLock:
    """Both halves, held for one command (`hold`); `ensure_held` raises once the lease is lost."""

    def __init__(self, run_dir: Path, store: ObjectStore, run_id: str, command: str, ttl_s: float = LEASE_TTL_S):
        self.run_dir, self.run_id = Path(run_dir), run_id
        self.me = Holder.me(command)
        self._fd: int | None = None
        self._lease = _Lease(store, run_id, ttl_s)

    def acquire(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = _read_holder(path.read_text())
            who = holder.describe() if holder else "another process"
            raise UserError(f"--output-dir {self.run_dir}: in use by {who}; wait for it or stop it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self.me.__dict__).encode(), 0)
        self._fd = fd
        # A child forked without exec (an environment's worker, a plugin's os.fork) shares the descriptor, and a
        # flock lasts while any process has it open: an orphan of the run kept the directory locked after the run
        # ended (issue 52). The child closes its copy at once; exec'd children never get one (not inheritable).
        os.register_at_fork(after_in_child=functools.partial(_close_in_child, weakref.ref(self)))
        try:
            self._lease.acquire(self.me)
        except BaseException:
            self.release()
            raise

    def ensure_held(self) -> None:
        if self._lease.lost is not None:
            raise Fault(f"run {self.run_id}: {self._lease.lost}; stopped before writing anything more")

    def release(self) -> None:
        self._lease.release()
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _close_in_child(ref: weakref.ref) -> None:
    """In a forked child: drop the parent's lock descriptor (the parent keeps the lock)."""
    lock = ref()
    if lock is not None and lock._fd is not None:
        with contextlib.suppress(OSError):
            os.close(lock._fd)
        lock._fd = None


@contextlib.contextmanager
def hold(run_dir: Path, store: ObjectStore, run_id: str, command: str):
    """Hold the run's lock for the block. One per run in a process: flows/live_run.py `open_run` takes it once,
    and the CLI's flow enters the run it opened."""
    lock = RunLock(run_dir, store, run_id, command)
    lock.acquire()
    try:
        yield lock
    finally:
        lock.release()
