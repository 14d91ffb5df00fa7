"""Child processes that do not outlive the flow process that started them.

A flow killed with SIGKILL runs no cleanup, so engines, the router and the trainer group would linger, holding
ports and memory, and a resumed run would start a second set beside them. Linux's parent-death signal asks the
kernel to SIGTERM the child when its parent goes. The "parent" is the thread that spawned the child: sluiceway
starts these processes from the flow's main thread, which lives as long as the run.

Also the one place that picks free loopback ports for the processes it starts.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import sys

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
