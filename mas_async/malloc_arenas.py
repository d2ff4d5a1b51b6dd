"""A bound on glibc's malloc arenas in a process whose threads come and go: the trainer's.

glibc gives each new thread an arena of its own at its first allocation, while fewer than 8 a core exist and
none is free, and keeps each arena's freed memory for the threads that later use it. Each re-formed weight
group starts gloo threads of its own, so a trainer that outlives many replicas spreads its allocations over more
and more arenas: the soak measured it (docs/faults.md, bench/memory_parts.py). Bounded to two, every thread
reuses the memory the ones before it freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("mas_async.malloc_arenas")

TRAINER_ARENAS = 2
ENV = "MALLOC_ARENA_MAX"
"""glibc's own variable: when the user sets it, it wins (glibc read it at start) and this module does nothing."""
M_ARENA_MAX = -8
"""mallopt's parameter number for the arena bound (glibc's malloc.h)."""


def cap_malloc_arenas(arenas: int) -> bool:
    """Bound the arenas this process creates from now on to `arenas` (those made before stay). False, and nothing
    changed, where the user set MALLOC_ARENA_MAX or the C library is not glibc."""
    if arenas < 1:
        raise ValueError(f"a process needs at least 1 malloc arena, got {arenas}")
    if ENV in os.environ:
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        log.info("not glibc: the malloc arenas of this process are left unbounded")
        return False
    return bool(libc.mallopt(M_ARENA_MAX, arenas))
