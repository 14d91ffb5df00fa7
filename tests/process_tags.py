"""Finding a test's own processes by a tag in their environment, never by command line.

A command-line pattern ("sluiceway.flows.cli engine") also matches the engines of another checkout or test
running on the same machine. A test instead starts its command with SLUICEWAY_TEST_TAG=<a fresh uuid>; every
process that command starts (engines, router, Prefect server, trainer group) inherits the variable.
"""

from __future__ import annotations

import os
import uuid

from sluiceway.infra.proc import processes_with_env

TAG_VARIABLE = "SLUICEWAY_TEST_TAG"


def new_tag() -> str:
    return uuid.uuid4().hex


def tagged_env(tag: str, base: dict | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the tag set."""
    return dict(os.environ if base is None else base) | {TAG_VARIABLE: tag}


def processes_tagged(tag: str) -> list[int]:
    """Live (not zombie) processes whose environment holds SLUICEWAY_TEST_TAG=tag."""
    return processes_with_env(TAG_VARIABLE, tag)


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on, from /proc (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                address, port = cols[1].split(":")
                raw = bytes.fromhex(address)
                # /proc prints each 32-bit word in host (little-endian) order
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                ip = ".".join(map(str, words)) if width == 8 else words.hex(":", 2)
                found.append((ip, int(port, 16)))
    return found


def process_tree(pid: int) -> list[int]:
    """`pid` and every live descendant of it, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree
