"""glibc's allocator told to give memory back: for a long-lived server whose many threads allocate tensors.

By default glibc serves an allocation below a *dynamic* threshold (it rises to 32 MiB after a large block is freed)
from the calling thread's arena, and keeps up to 8 arenas a core, each growing by 64 MiB heaps it rarely returns.
The Tinker server's request threads each allocate and free megabytes of tensors a request, so its arenas only grew:
49 heaps of 64 MiB held 2.2 GB of its 4.8 GB after 1,375 sampling requests of tinker-cookbook's guess_number
(docs/benchmarks.md, "Tinker server memory"). `bound_heap_growth` fixes the threshold (every block over it is its
own mapping, unmapped when freed) and caps the arenas, before the server starts its threads. Other C libraries
(musl) have no `mallopt`: nothing is done there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
M_ARENA_MAX = -8
MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value, kept fixed
ARENA_MAX = 2


def bound_heap_growth(mmap_threshold: int = MMAP_THRESHOLD, arena_max: int = ARENA_MAX) -> bool:
    """Whether glibc took both settings (call before starting threads; later arenas and blocks follow them)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(M_ARENA_MAX, arena_max) == 1
    if not ok:
        log.warning("malloc: glibc refused the mmap threshold or the arena cap; the server's memory may grow")
    return ok
