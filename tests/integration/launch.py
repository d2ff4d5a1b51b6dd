"""Helpers for integration tests that start a real deployment: run `mas-async train` as a subprocess,
find its children by pid, and always clean them up by pid."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.paths import ROOT

__all__ = ["FAST", "ROOT", "alive", "child_pids", "cleanup", "kill_when", "run_train", "start_train", "wait_for_rows"]

# Small and fast: 2 env workers, tiny batches; every role still runs as its own process.
FAST = ["rollout.batch_size=4", "eval.every=1", "eval.size=4", "algorithm.k=4"]


def start_train(
    config: str, run_dir: Path, *overrides: str, runner: str = "mas_async train", env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`mas-async train` in the background (`runner`: another module that takes the same arguments), with
    the extra environment `env` (every process of the run inherits it)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            *runner.split(),
            str(ROOT / config),
            f"run.output_dir={run_dir}",
            *overrides,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )


def run_train(config: str, run_dir: Path, *overrides: str, timeout: float = 400) -> tuple[int, str]:
    """`mas-async train` to its end (or `timeout`): its exit status and output; cleaned up by pid."""
    proc = start_train(config, run_dir, *overrides)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    finally:
        cleanup(proc, run_dir)


def child_pids(run_dir: Path, timeout: float = 60.0) -> dict[str, int]:
    path = run_dir / "pids.json"
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.1)
    return json.loads(path.read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def wait_for_rows(run_dir: Path, count: int, timeout: float) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if len(rows) >= count:
                return rows
        time.sleep(0.2)
    raise TimeoutError(f"fewer than {count} metrics rows in {timeout}s")


RUN_DIRS: list[Path] = []
"""The run directories of the test under way, whose metrics' keys its teardown checks against the metrics
reference (tests/integration/conftest.py)."""


def cleanup(proc: subprocess.Popen, run_dir: Path) -> None:
    """Kill the launcher and every child it recorded, by pid (never by name)."""
    RUN_DIRS.append(run_dir)
    pids = []
    if (run_dir / "pids.json").exists():
        pids = list(json.loads((run_dir / "pids.json").read_text()).values())
    for pid in [proc.pid, *pids]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(timeout=10)


def kill_when(run_dir: Path, name: str, watched: str, pattern: str, delay_s: float = 0.0) -> int:
    """SIGKILL process `name` as soon as process `watched`'s log matches `pattern` (and `delay_s` later)."""
    deadline = time.monotonic() + 180
    log = run_dir / "logs" / f"{watched.replace('/', '-')}.log"
    while time.monotonic() < deadline:
        if log.exists() and re.search(pattern, log.read_text(errors="replace")):
            time.sleep(delay_s)
            pid = json.loads((run_dir / "pids.json").read_text())[name]
            os.kill(pid, signal.SIGKILL)
            return pid
        time.sleep(0.02)
    raise TimeoutError(f"{watched}'s log never matched {pattern!r}")
