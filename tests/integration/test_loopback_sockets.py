"""The in-process trainer's process group listens on loopback only (issue 20: its c10d TCPStore listened on every
interface, unauthenticated)."""

from __future__ import annotations

import subprocess
import sys

from process_tags import listening_sockets

# A world of one, as the in-process trainer starts it; then it waits to be looked at.
CHILD = """
import sys
from sluiceway.models.megatron_gpt import init_parallel_state
init_parallel_state(backend="gloo")
print("ready", flush=True)
sys.stdin.read()
"""


def test_process_group_of_one_listens_on_loopback_only():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        sockets = listening_sockets(child.pid)
        assert sockets, "the process group should listen somewhere (its store)"
        assert all(ip in ("127.0.0.1", "0000:0000:0000:0000:0000:0000:0000:0001") for ip, _ in sockets), sockets
    finally:
        child.stdin.close()
        child.wait(timeout=30)
