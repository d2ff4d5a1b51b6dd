"""Roles for the fork server's tests: each reports what its process looks like, or exits in a given way."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


class _Probe:
    def __init__(self, out: str) -> None:
        self.out = out
        self.torch_was_loaded = "torch" in sys.modules  # before this process imported anything itself

    def run(self) -> None:
        print("probe says hello")
        facts = {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "sid": os.getsid(0),
            "pgid": os.getpgid(0),
            "cwd": os.getcwd(),
            "env": dict(os.environ),
            "torch_was_loaded": self.torch_was_loaded,
            "stdin": sys.stdin.read(),
            "cmdline": Path("/proc/self/cmdline").read_text(),
        }
        Path(self.out).write_text(json.dumps(facts))


def probe(config: Any, deployment: Any, run_dir: Path, *, index: int, policy: str, out: str) -> _Probe:
    return _Probe(out)


def exit_with(config: Any, deployment: Any, run_dir: Path, *, index: int, policy: str, code: int) -> Any:
    raise SystemExit(code)


def crash(config: Any, deployment: Any, run_dir: Path, *, index: int, policy: str) -> Any:
    raise ValueError("the probe crashed on purpose")


class _Sleeper:
    def run(self) -> None:
        time.sleep(60)


def sleeper(config: Any, deployment: Any, run_dir: Path, *, index: int, policy: str) -> _Sleeper:
    return _Sleeper()


ROLES = {"probe": probe, "exit_with": exit_with, "crash": crash, "sleeper": sleeper}
