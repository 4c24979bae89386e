"""The CPU's memory: how much this process may use, and keeping glibc from returning large
freed buffers to the OS between forward passes.

By default glibc serves allocations above its mmap threshold (at most 32 MiB) with fresh
mappings and unmaps them on free, so every forward pass page-faults its activations, logits and
attention temporaries in again: on CPU that costs more than the matmuls. Raising the mmap and
trim thresholds makes those buffers come from (and go back to) the heap, where they are reused.
jemalloc or tcmalloc preloaded by the user do the same; then this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
from pathlib import Path

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 30


@functools.cache
def reuse_large_allocations() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False if not on glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, THRESHOLD))


CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")  # cgroup v2: bytes, or "max"


def total_memory_bytes() -> int:
    """The memory this process may use: the machine's, or its cgroup's limit where lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = CGROUP_MEMORY_MAX.read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total
