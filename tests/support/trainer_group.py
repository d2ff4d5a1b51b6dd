"""Stand in for a policy's trainer (rank 0 of its weight group, in the test's process) and join a backend to it.

Rank 0's store listens on a port the kernel picks as it binds (port 0), so nothing started meanwhile (a vLLM
engine opens ports of its own) can take it first, and a rank 0 that fails says why instead of leaving the
backend waiting out its bound.
"""

from __future__ import annotations

import threading
from typing import Any

from mas_async.weights.group import WeightGroup, open_weight_group
from mas_async.weights.store import open_store

HOST = "127.0.0.1"
JOIN_TIMEOUT_S = 300.0


def join_trainer_group(backend: Any, policy: str, *, store: Any = None, generation: int = 0) -> WeightGroup:
    """Form generation `generation` of `policy`'s 2-rank gloo weight group with `backend` as rank 1; returns
    rank 0's side. A re-formed generation meets on the store of the first (`store`)."""
    if store is None:
        store = open_store(HOST, 0, 2, is_master=True, timeout_s=JOIN_TIMEOUT_S)
    joined: dict[str, Any] = {}

    def open_rank_0() -> None:
        try:
            joined["group"] = open_weight_group(
                policy=policy, backend="gloo", host=HOST, port=store.port, rank=0, world_size=2,
                timeout_s=JOIN_TIMEOUT_S, generation=generation, store=store,
            )  # fmt: skip
        except BaseException as e:  # handed to the caller below
            joined["error"] = e

    opener = threading.Thread(target=open_rank_0, name="trainer-rank-0", daemon=True)
    opener.start()
    try:
        backend.join_weight_group(
            policy=policy, backend="gloo", host=HOST, port=store.port, rank=1, world_size=2, generation=generation
        )
    except BaseException as e:
        e.add_note(f"rank 0 (this process) meanwhile: {joined.get('error') or ('formed' if joined else 'waiting')}")
        raise
    opener.join(timeout=60)
    if "error" in joined:
        raise RuntimeError(f"rank 0 of {policy!r}'s weight group failed: {joined['error']!r}") from joined["error"]
    if opener.is_alive() or "group" not in joined:
        raise TimeoutError(f"rank 0 of {policy!r}'s weight group did not form within 60 s of rank 1 joining")
    return joined["group"]
