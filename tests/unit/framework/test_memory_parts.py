"""bench/memory_parts.py: memory a thread mallocs is counted in glibc's thread arenas, the main thread's in the
heap, from outside the process's own accounting (smaps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.memory_parts import ARENA_BYTES, part_of

ROOT = Path(__file__).resolve().parents[3]
MB = 1 << 20

FILL = """
import ctypes, json, os, sys, threading
from bench.memory_parts import memory_parts
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
kept = []
def fill():  # 20 MiB in 32 KiB blocks: under malloc's mmap threshold, so from the calling thread's arena
    for _ in range(640):
        p = libc.malloc(32768)
        ctypes.memset(p, 1, 32768)
        kept.append(p)
before = memory_parts(os.getpid())
if sys.argv[1] == "thread":
    t = threading.Thread(target=fill)
    t.start()
    t.join()
else:
    fill()
after = memory_parts(os.getpid())
print(json.dumps({k: after[k] - before[k] for k in after}))
"""


def _grown(where: str) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", FILL, where], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(out.stdout)


@pytest.mark.parametrize(("where", "part"), [("thread", "arenas"), ("main", "heap")])
def test_a_threads_mallocs_land_in_the_arenas_the_main_threads_in_the_heap(where: str, part: str) -> None:
    grown = _grown(where)
    assert grown[part] >= 18 * MB, grown
    others = {k: v for k, v in grown.items() if k != part}
    assert all(v < 4 * MB for v in others.values()), grown


def test_the_parts_of_a_mapping() -> None:
    assert part_of(0x5555_0000_0000, 4 * MB, "[heap]") == "heap"
    assert part_of(3 * ARENA_BYTES, ARENA_BYTES, "[anon]") == "arenas"
    assert part_of(3 * ARENA_BYTES + 4096, MB, "[anon]") == "anon"  # off the alignment: malloc's own mmap, a stack
    assert part_of(3 * ARENA_BYTES, 2 * ARENA_BYTES, "[anon]") == "anon"  # bigger than an arena's heap
    assert part_of(3 * ARENA_BYTES, MB, "[stack]") == "anon"
    assert part_of(3 * ARENA_BYTES, MB, "/usr/lib/libc.so.6") == "file"
