"""An env worker's tokenizer keeps no memory per prompt it has seen: the built-in tiny-char tokenizer (a BPE with
no pre-tokenizer) would otherwise cache every distinct piece of prompt text, up to 10,000 of them, which the
hour-long soak measured as env workers growing ~30 MB in their first ~10 minutes."""

from __future__ import annotations

import ctypes
import ctypes.util
import random
from pathlib import Path

import pytest

from mas_async.rollout.chat_prompt import chat_prompt_ids
from mas_async.rollout.env_worker import load_tokenizer
from mas_async.tiny_model import materialise


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _malloced_bytes() -> int:
    """Bytes malloc has handed out and not had back (native code's too, which tracemalloc does not see)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def test_distinct_prompts_leave_no_memory_in_the_tokenizer(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(materialise("builtin:tiny-char", tmp_path)))
    rng = random.Random(0)

    def prompt() -> list[dict[str, str]]:  # a Plan-Path-like observation, never the same twice
        grid = "\n".join("".join(rng.choice(".#") for _ in range(5)) for _ in range(5))
        return [{"role": "system", "content": "You move vertically."}, {"role": "user", "content": f"{grid}\nA=1,2"}]

    for _ in range(200):  # (first calls: the template's compilation, the allocator's own warm-up)
        chat_prompt_ids(tokenizer, prompt())
    before = _malloced_bytes()
    for _ in range(3000):
        chat_prompt_ids(tokenizer, prompt())
    grown = _malloced_bytes() - before
    # With the cache: ~1.4 KB a prompt (4+ MB here); without it, nothing that lasts.
    assert grown < 1_000_000, f"{grown / 1e6:.1f} MB kept after 3,000 distinct prompts"
