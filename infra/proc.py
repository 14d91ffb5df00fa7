"""Child processes that do not outlive the flow process that started them.

A flow killed with SIGKILL runs no cleanup, so engines, the router and the trainer group would linger, holding
ports and memory, and a resumed run would start a second set beside them. Linux's parent-death signal asks the
kernel to SIGTERM the child when its parent goes. The "parent" is the thread that spawned the child: sluiceway
starts these processes from the flow's main thread, which lives as long as the run.
"""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """`preexec_fn` for subprocess.Popen: SIGTERM this child when its parent dies (Linux; a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
