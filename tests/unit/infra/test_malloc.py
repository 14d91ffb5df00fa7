"""infra/malloc.py: after `bound_heap_growth`, a block over the threshold is a mapping of its own (given back when
freed), even after a larger block was freed, which by glibc's default raises the threshold so that such blocks come
from an arena's heaps and stay there (the Tinker server's growth, docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import ctypes
if {bound}:
    from sluiceway.infra.malloc import bound_heap_growth
    assert bound_heap_growth()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(8 << 20))  # freeing a mapped 8 MiB block raises glibc's dynamic threshold past it
p = libc.malloc(512 << 10)
for line in open("/proc/self/maps"):
    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
    if lo <= p < hi:
        print(hi - lo)
"""


def _mapping_size(bound: bool) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE.format(bound=bound)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return int(out.stdout.split()[0])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_block_over_the_threshold_is_its_own_mapping():
    assert _mapping_size(bound=True) < 1 << 20  # its own: 512 KiB and a page
    assert _mapping_size(bound=False) >= 1 << 20  # the heap's (or an arena's), which glibc keeps
