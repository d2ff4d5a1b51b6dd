"""The CURVE keys of a test's run, and a bounded wait for the socket tests that use them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from mas_async.config import Config
from mas_async.runtime.curve import issued_secret, prepare_keys


def issue_keys(config: Config, run_dir: Path, names: list[str]) -> tuple[str, dict[str, str]]:
    """The keys of a start of the run: its folder and every named process's secret key."""
    keys_dir = prepare_keys(config, run_dir, names)
    assert keys_dir is not None, "the config has CURVE off"
    return keys_dir, {name: issued_secret(keys_dir, name) for name in names}


async def until(condition: Callable[[], bool], what: str, wait_s: float) -> None:
    """Wait until `condition()` holds; fail naming `what` after `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {wait_s}s: {what}")
        await asyncio.sleep(0.01)
