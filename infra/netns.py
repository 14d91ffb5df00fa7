"""A region behind a WAN-like link, on one machine: a network namespace joined to this one by a veth pair.

    with WanLink("remote", rate="1gbit") as link:                      # 10.77.0.1 here, 10.77.0.2 there
        with DelayProxy((link.home_ip, 0), ("127.0.0.1", s3_port), delay_s=0.040, reset_fraction=0.001) as p:
            proc = link.popen([sys.executable, "-m", "sluiceway.flows.cli", "pools", "up", ...], env=...)
            ...                                                        # the pool reaches the store at p.url
            link.cut(); ...; link.restore()                            # the link dropped, then back

- **Bandwidth**: both veth ends are shaped with ``tc`` (``htb``, or ``tbf``), so each direction carries at most
  ``rate``. These kernels have no ``netem``: latency and loss come from the proxy.
- **Latency and loss**: :class:`DelayProxy` is a TCP forwarder that holds every chunk ``delay_s`` in each
  direction before passing it on (40 ms each way: an 80 ms round trip for every request and its answer) and
  resets a fraction of the connections it accepts (RST to the client partway through). It acknowledges data
  at once, so a sender's TCP window is not limited by the round trip; only request/response latency is.
  Its listening socket and its upstream connections may each live in either namespace (``listen_ns``,
  ``target_ns``): a socket belongs to the namespace of the thread that created it (``setns`` is per thread).
- **A dropped link**: ``cut()`` replaces both ends' qdisc by ``blackhole`` (every packet silently lost, both
  ways, as when a WAN path goes away: connections hang, nothing is refused) or, with ``mode="down"``, takes
  the home end down (the home side gets "network unreachable" at once; the remote side sees no carrier).
  ``restore()`` puts the shaping back.

Everything is removed on exit, on failure part way through setting up, and at interpreter exit: the processes
left in the namespace (all started by us) are stopped, the veth pair and the namespace deleted. A namespace of
the same name left behind by a killed process, with no process in it, is removed before a new one is made.
Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2; otherwise :class:`NetnsUnavailable` says why.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import logging
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Self, TypeVar

from sluiceway.infra.proc import die_with_parent

log = logging.getLogger("sluiceway.netns")

T = TypeVar("T")

_CLONE_NEWNET = 0x40000000
_NETNS_DIR = Path("/var/run/netns")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$", re.I)
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


class NetnsUnavailable(RuntimeError):
    """Network namespaces, veth pairs or tc cannot be used here (not root, no iproute2, a locked-down kernel)."""


def rate_bits(rate: str) -> int:
    """``"1gbit"`` -> 1_000_000_000 (tc's units: bit, kbit, mbit, gbit; decimal)."""
    m = _RATE.match(rate.strip())
    if not m:
        raise ValueError(f"rate {rate!r}: a number and one of bit, kbit, mbit, gbit (e.g. 1gbit, 100mbit)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def netns_problem() -> str | None:
    """Why namespaces cannot be made here (None: nothing found; making one may still fail)."""
    if not Path("/proc/self/ns/net").exists():
        return "no network namespaces on this system"
    if os.geteuid() != 0:
        return "network namespaces and veth pairs need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no '{tool}' command (iproute2)"
    return None


def _setns(name: str) -> None:
    """Move the calling thread into the network namespace ``name`` (other threads stay where they are)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(_NETNS_DIR / name, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


def in_netns(name: str | None, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a fresh thread inside network namespace ``name`` (None: this one).

    Sockets it creates (an HTTP client's, say) belong to that namespace for their whole life."""
    if name is None:
        return fn(*args, **kwargs)
    with ThreadPoolExecutor(1, initializer=_setns, initargs=(name,)) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


class WanLink:
    """A network namespace ``name`` and a shaped veth pair to it; a context manager (removed on exit).

    ``home_ip`` is this namespace's end, ``remote_ip`` the namespace's. ``rate`` (tc units) caps each
    direction; ``shaper`` is ``htb`` (default) or ``tbf``.
    """

    def __init__(self, name: str = "remote", *, subnet: str = "10.77.0", rate: str = "1gbit", shaper: str = "htb"):
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,12}", name):
            raise ValueError(f"namespace name {name!r}: 1-12 of [A-Za-z0-9_.-] (interface names are short)")
        if shaper not in ("htb", "tbf"):
            raise ValueError(f"shaper {shaper!r}: htb or tbf")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"subnet {subnet!r}: the first three octets of a /24, e.g. 10.77.0")
        self.name, self.rate, self.shaper = name, rate, shaper
        self.rate_bits = rate_bits(rate)
        self.home_ip, self.remote_ip = f"{subnet}.1", f"{subnet}.2"
        self.home_dev, self.remote_dev = f"{name}-h", f"{name}-r"
        self.state = "closed"  # closed | up | cut
        self._made = False

    def __repr__(self) -> str:
        return f"WanLink({self.name!r}, {self.home_ip} <-> {self.remote_ip}, {self.rate} {self.shaper}, {self.state})"

    # -- set up and take down ---------------------------------------------------------------------------------

    def start(self) -> Self:
        problem = netns_problem()
        if problem:
            raise NetnsUnavailable(problem)
        self._remove_leftover()
        try:
            _ip("netns", "add", self.name)
        except RuntimeError as exc:
            raise NetnsUnavailable(f"cannot make network namespace {self.name!r}: {exc}") from None
        self._made = True
        atexit.register(self.close)
        try:
            _ip("link", "add", self.home_dev, "type", "veth", "peer", "name", self.remote_dev, "netns", self.name)
            _ip("addr", "add", f"{self.home_ip}/24", "dev", self.home_dev)
            _ip("link", "set", self.home_dev, "up")
            self._in("ip", "addr", "add", f"{self.remote_ip}/24", "dev", self.remote_dev)
            self._in("ip", "link", "set", self.remote_dev, "up")
            self._in("ip", "link", "set", "lo", "up")  # the pool's router and engines listen on 127.0.0.1 there
            self._shape()
        except BaseException as exc:
            self.close()
            if isinstance(exc, RuntimeError):
                raise NetnsUnavailable(f"cannot set up the link to {self.name!r}: {exc}") from None
            raise
        self.state = "up"
        log.info("link %s: %s <-> %s, %s (%s)", self.name, self.home_ip, self.remote_ip, self.rate, self.shaper)
        return self

    def _remove_leftover(self) -> None:
        if (_NETNS_DIR / self.name).exists():
            pids = _ip("netns", "pids", self.name, check=False).stdout.split()
            if pids:
                raise NetnsUnavailable(f"network namespace {self.name!r} exists and has processes {' '.join(pids)}: "
                                       f"in use; pick another name")  # fmt: skip
            log.warning("removing network namespace %r left behind by an earlier run", self.name)
            _ip("netns", "del", self.name, check=False)
        if Path("/sys/class/net", self.home_dev).exists():
            _ip("link", "del", self.home_dev, check=False)

    def close(self) -> None:
        """Stop what runs in the namespace, delete the veth pair and the namespace. Idempotent."""
        atexit.unregister(self.close)
        if not self._made:
            return
        self._made, self.state = False, "closed"
        self._stop_processes()
        _ip("link", "del", self.home_dev, check=False)  # deletes both ends
        _ip("netns", "del", self.name, check=False)
        deadline = time.monotonic() + 10  # namespace teardown is asynchronous in the kernel
        while Path("/sys/class/net", self.home_dev).exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _stop_processes(self) -> None:
        """Every process still in the namespace was started by us (through ``popen``): TERM, then KILL."""

        def pids() -> list[int]:
            out = _ip("netns", "pids", self.name, check=False).stdout.split()
            return [int(p) for p in out if p.isdigit() and int(p) != os.getpid()]

        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            left = pids()
            if not left:
                return
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while pids() and time.monotonic() < deadline:
                time.sleep(0.1)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- shaping, and dropping the link ---------------------------------------------------------------------

    def _tc(self, dev: str, *args: str) -> None:
        cmd = ["tc", *args[:2], "dev", dev, *args[2:]]
        if dev == self.remote_dev:
            cmd = ["ip", "netns", "exec", self.name, *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")

    def _shape(self) -> None:
        rate_bytes = self.rate_bits // 8
        for dev in (self.home_dev, self.remote_dev):
            with contextlib.suppress(RuntimeError):  # none yet (veth: noqueue), ours, or a cut's blackhole
                self._tc(dev, "qdisc", "del", "root")
            if self.shaper == "htb":
                self._tc(dev, "qdisc", "add", "root", "handle", "1:", "htb", "default", "10")
                # One class: its quantum only matters between classes, set it so tc has nothing to warn about.
                quantum = str(min(max(rate_bytes // 10, 1600), 200_000))
                self._tc(dev, "class", "add", "parent", "1:", "classid", "1:10", "htb", "rate", self.rate,
                         "ceil", self.rate, "quantum", quantum)  # fmt: skip
            else:  # tbf: a bucket of 10 ms at the rate (at least 64 KiB: veth passes GSO packets that large)
                burst = str(max(rate_bytes // 100, 65536))
                self._tc(dev, "qdisc", "add", "root", "tbf", "rate", self.rate, "burst", burst, "latency", "200ms")

    def cut(self, mode: str = "blackhole") -> None:
        """Drop the link: ``blackhole`` loses every packet both ways; ``down`` takes the home end down."""
        if mode == "blackhole":
            for dev in (self.home_dev, self.remote_dev):
                self._tc(dev, "qdisc", "replace", "root", "blackhole")
        elif mode == "down":
            _ip("link", "set", self.home_dev, "down")
        else:
            raise ValueError(f"cut mode {mode!r}: blackhole or down")
        self.state = "cut"
        log.warning("link %s: cut (%s)", self.name, mode)

    def restore(self) -> None:
        """The link back up, shaped as before."""
        if Path("/sys/class/net", self.home_dev, "operstate").read_text().strip() == "down":
            _ip("link", "set", self.home_dev, "up")
        self._shape()
        self.state = "up"
        log.warning("link %s: restored", self.name)

    # -- what crosses it, and what runs on the other side --------------------------------------------------

    def counters(self) -> dict[str, int]:
        """Bytes and packets the home end sent to (``tx_*``) and received from (``rx_*``) the namespace."""
        stats = Path("/sys/class/net", self.home_dev, "statistics")
        return {k: int((stats / k).read_text()) for k in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")}

    def _in(self, *cmd: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(["ip", "netns", "exec", self.name, *cmd], capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} in {self.name}: {proc.stderr.strip() or proc.returncode}")
        return proc

    def popen(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``cmd`` inside the namespace (``ip netns exec``), in its own session, dying with this process."""
        kwargs.setdefault("start_new_session", True)
        kwargs.setdefault("preexec_fn", die_with_parent)
        return subprocess.Popen(["ip", "netns", "exec", self.name, *cmd], **kwargs)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(...)`` with its sockets inside the namespace (e.g. a request to 127.0.0.1 over there)."""
        return in_netns(self.name, fn, *args, **kwargs)


class DelayProxy:
    """A TCP forwarder that delays each direction by ``delay_s`` and resets ``reset_fraction`` of connections.

    ``reset_per_request``: also cut an open connection during a request (a client's data after the target's
    answer) with this probability: long-lived keep-alive connections, which a per-connection fraction seldom
    hits, see resets too.

    Listens on ``listen`` (host, port; port 0 picks one) inside ``listen_ns`` and forwards every connection to
    ``target`` inside ``target_ns`` (None: this process's namespace). ``refuse()`` closes the listening socket
    and cuts open connections (a store that stopped answering); ``accept()`` listens again on the same port.
    ``stats`` counts connections, exchanges (a client's data after the target's answer, or first: about one per
    request, i.e. per round trip paid), resets and bytes each way (``up``: client to target).
    """

    CHUNK = 256 * 1024

    def __init__(
        self,
        listen: tuple[str, int],
        target: tuple[str, int],
        *,
        delay_s: float = 0.0,
        reset_fraction: float = 0.0,
        reset_per_request: float = 0.0,
        listen_ns: str | None = None,
        target_ns: str | None = None,
        window_bytes: int = 32 * 1024 * 1024,
        seed: int | None = None,
    ) -> None:
        if delay_s < 0 or not 0.0 <= reset_fraction <= 1.0 or not 0.0 <= reset_per_request <= 1.0:
            raise ValueError("delay_s >= 0, and reset_fraction and reset_per_request in [0, 1]")
        self.listen, self.target = listen, target
        self.delay_s, self.reset_fraction, self.reset_per_request = delay_s, reset_fraction, reset_per_request
        self.listen_ns, self.target_ns = listen_ns, target_ns
        self.window_bytes = window_bytes
        self._rng = random.Random(seed)
        self.stats = {"connections": 0, "exchanges": 0, "resets": 0, "refused": 0, "up": 0, "down": 0}
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task] = set()
        self._target_exec: ThreadPoolExecutor | None = None

    @property
    def url(self) -> str:
        return f"http://{self.listen[0]}:{self.port}"

    def __repr__(self) -> str:
        return (f"DelayProxy({self.listen[0]}:{self.port} -> {self.target[0]}:{self.target[1]}, "
                f"{self.delay_s * 1000:.0f} ms each way, resets {self.reset_fraction:g})")  # fmt: skip

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> Self:
        if self._thread is not None:
            return self
        if self.target_ns is not None:  # a thread that lives in the target's namespace makes upstream sockets
            self._target_exec = ThreadPoolExecutor(1, initializer=_setns, initargs=(self.target_ns,))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"delay-proxy-{self.listen[1]}",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        try:
            self.accept()
        except BaseException:
            self.stop()
            raise
        return self

    def _listen_socket(self) -> socket.socket:
        def make() -> socket.socket:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((self.listen[0], self.port or self.listen[1]))
            s.listen(128)
            s.setblocking(False)
            return s

        return in_netns(self.listen_ns, make)

    def accept(self) -> None:
        """(Re)open the listening socket (on the port it had, if any)."""
        sock = self._listen_socket()
        self.port = sock.getsockname()[1]

        async def serve() -> None:
            self._server = await asyncio.start_server(self._handle, sock=sock, limit=self.CHUNK)

        asyncio.run_coroutine_threadsafe(serve(), self._loop).result(timeout=30)

    def refuse(self) -> None:
        """Close the listening socket (new connections refused) and cut the open ones."""

        async def shut() -> None:
            if self._server is not None:
                self._server.close()
                self._server = None
            for task in list(self._conns):
                task.cancel()
            await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(timeout=30)

    def stop(self) -> None:
        if self._loop is None:
            return
        if self._loop.is_running():
            with contextlib.suppress(Exception):
                self.refuse()
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._loop.close()
        self._loop, self._thread = None, None
        if self._target_exec is not None:
            self._target_exec.shutdown(wait=False)
            self._target_exec = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- one connection ----------------------------------------------------------------------------------------

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        loop = asyncio.get_running_loop()
        if self._target_exec is None:
            return await asyncio.open_connection(*self.target, limit=self.CHUNK)
        sock = await loop.run_in_executor(self._target_exec, socket.socket, socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, self.target)
        except BaseException:
            sock.close()
            raise
        return await asyncio.open_connection(sock=sock, limit=self.CHUNK)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conns.add(task)
        self.stats["connections"] += 1
        # A connection to reset: after a random number of bytes (or when either side first ends), RST.
        doomed = self._rng.random() < self.reset_fraction
        conn = _Conn(cut_after=self._rng.randrange(256 * 1024) if doomed else None)
        upstream_w = None
        try:
            try:
                upstream_r, upstream_w = await asyncio.wait_for(self._connect(), timeout=30)
            except (TimeoutError, OSError):
                self.stats["refused"] += 1
                _reset(client_w)
                return
            pumps = asyncio.gather(self._pump(client_r, upstream_w, "up", conn),
                                   self._pump(upstream_r, client_w, "down", conn))  # fmt: skip
            pumps.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: never logged
            broken = asyncio.create_task(conn.broken.wait())
            try:
                await asyncio.wait([pumps, broken], return_when=asyncio.FIRST_COMPLETED)
            finally:
                pumps.cancel()
                broken.cancel()
            if conn.broken.is_set():  # cut on purpose, or one side failed: the other side learns by an RST
                self.stats["resets"] += conn.cut
                _reset(client_w)
                _reset(upstream_w)
        except asyncio.CancelledError:  # refuse() or stop(): cut both sides
            _reset(client_w)
            if upstream_w is not None:
                _reset(upstream_w)
        finally:
            for w in (client_w, upstream_w):
                if w is not None and not w.is_closing():
                    w.close()
            self._conns.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str,
                    conn: _Conn) -> None:  # fmt: skip
        """Copy ``reader`` to ``writer``, every chunk held ``delay_s``, at most ``window_bytes`` in flight; an
        error on either side sets ``conn.broken``."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()
        in_flight = 0
        room = asyncio.Event()
        room.set()

        async def receive() -> None:
            nonlocal in_flight
            while True:
                data = await reader.read(self.CHUNK)
                if conn.cut_after is not None and (not data or conn.moved + len(data) >= conn.cut_after):
                    conn.cut = 1  # its time has come, or it ends before it: reset it now
                    conn.broken.set()
                    return
                queue.put_nowait((loop.time() + self.delay_s, data or None))
                if not data:
                    return
                self.stats[direction] += len(data)
                if direction == "up" and conn.last != "up":
                    self.stats["exchanges"] += 1
                    if conn.cut_after is None and self._rng.random() < self.reset_per_request:
                        conn.cut_after = conn.moved + self._rng.randrange(len(data) + 64 * 1024)  # during this one
                conn.last = direction
                conn.moved += len(data)
                in_flight += len(data)
                if in_flight > self.window_bytes:
                    room.clear()
                    await room.wait()

        async def send() -> None:
            nonlocal in_flight
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if data is None:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
                in_flight -= len(data)
                if in_flight <= self.window_bytes:
                    room.set()

        tasks = [asyncio.create_task(receive()), asyncio.create_task(send())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            if any(t.exception() is not None for t in done):
                conn.broken.set()
        finally:
            for t in tasks:
                t.cancel()


class _Conn:
    """What the two directions of one proxied connection share."""

    def __init__(self, cut_after: int | None) -> None:
        self.cut_after = cut_after  # reset once this many bytes went through (None: never)
        self.moved = 0
        self.cut = 0
        self.last = ""  # the direction data last went
        self.broken = asyncio.Event()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (SO_LINGER 0), not a FIN: the peer sees 'connection reset'."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError, ValueError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
