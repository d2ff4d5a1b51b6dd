"""Where a process's resident memory lies, from /proc/PID/smaps: glibc's main heap, its per-thread arenas, other
anonymous mappings (large allocations malloc maps on their own, thread stacks, torch's), and files.

The soak (bench/soak.py) records these for the roles whose RSS it breaks down, so a growth says which of them
grows: per-thread arenas filling as new threads start point at malloc, not at a leak of objects.
"""

from __future__ import annotations

import psutil

PARTS = ("heap", "arenas", "anon", "file")
ARENA_BYTES = 64 << 20
"""glibc's HEAP_MAX_SIZE on 64-bit: a thread arena's heaps are mapped at multiples of it, at most that size each."""
ANON = "[anon]"
"""psutil's name for an unnamed mapping."""


def part_of(start: int, size: int, path: str) -> str:
    """The part a mapping at address `start` of `size` bytes, named `path` in smaps, belongs to."""
    if path == "[heap]":
        return "heap"
    if path and not path.startswith("["):
        return "file"
    if path in ("", ANON) and start % ARENA_BYTES == 0 and size <= ARENA_BYTES:
        return "arenas"
    return "anon"  # unnamed mappings off the arena alignment, thread stacks, [stack], [anon:...]


def memory_parts(pid: int) -> dict[str, int]:
    """Resident bytes of process `pid` by part (PARTS). Raises psutil's errors for a process gone or hidden."""
    parts = dict.fromkeys(PARTS, 0)
    for m in psutil.Process(pid).memory_maps(grouped=False):
        low, high = (int(a, 16) for a in m.addr.split("-"))
        parts[part_of(low, high - low, m.path)] += m.rss
    return parts
