"""mas_async/malloc_arenas.py: a trainer's threads share one malloc arena instead of one each, and a user's
MALLOC_ARENA_MAX wins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mas_async.malloc_arenas import cap_malloc_arenas

ROOT = Path(__file__).resolve().parents[3]

THREADS = """
import ctypes, json, os, sys, threading
import psutil
from bench.memory_parts import part_of
from mas_async.malloc_arenas import cap_malloc_arenas
capped = cap_malloc_arenas(int(sys.argv[1])) if sys.argv[1] != "none" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
kept = []
together = threading.Barrier(8)
def fill():  # all 8 alive at once: none can take over an arena another has left
    together.wait()
    for _ in range(32):
        p = libc.malloc(32768)
        ctypes.memset(p, 1, 32768)
        kept.append(p)
    together.wait()
threads = [threading.Thread(target=fill) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
maps = psutil.Process(os.getpid()).memory_maps(grouped=False)
heaps = 0
for m in maps:
    low, high = (int(a, 16) for a in m.addr.split("-"))
    heaps += part_of(low, high - low, m.path) == "arenas" and "rw" in m.perms
print(json.dumps({"capped": capped, "thread_heaps": heaps}))
"""


def _run(cap: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", THREADS, cap], cwd=ROOT, env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def test_capped_the_threads_share_one_arena() -> None:
    free = _run("none")
    assert free["thread_heaps"] >= 4, free  # glibc's default: a new arena for each new thread, up to 8 a core
    capped = _run("2")
    assert capped == {"capped": True, "thread_heaps": 1}, capped


def test_the_users_malloc_arena_max_wins() -> None:
    assert _run("2", MALLOC_ARENA_MAX="4") == {"capped": False, "thread_heaps": 3}


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 malloc arena"):
        cap_malloc_arenas(0)
