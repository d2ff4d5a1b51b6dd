"""How many lost processes the launcher may still replace: `cluster.max_restarts` per role within
`cluster.restart_window_s`, and `cluster.max_run_restarts` whole-run restarts, each after progress.

An env worker or an inference replica is replaced alone (the router sends its episodes or requests
elsewhere meanwhile, and re-forms a replica's weight group; `router.faults.replaced_alone` says which).
A lost trainer or router cannot be replaced alone (the weights it held or the books it kept are gone),
so the launcher restarts the whole run from its last complete checkpoint instead (docs/faults.md).
A role that keeps
dying within the window uses up its budget, and the run then stops with the failure named, as it would
without restarts.

A window alone does not end a fault that recurs: data order and seeds are deterministic, so a run that
fails at iteration N (an OOM on one long prompt) fails there again after every restart, and once a cycle
takes longer than the window allows, it would restart for ever. So whole-run restarts also have a total
(`RunRestarts`: `cluster.max_run_restarts` over the run's life) and must be earned: a restart after the
first is allowed only if the run wrote a complete checkpoint newer than the one the previous restart
resumed from. The record is RUN_DIR/restarts.jsonl, one line per restart, so a launcher that resumes the
run (`resume=RUN_DIR`, a requeued SLURM job) keeps counting.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict, deque
from pathlib import Path
from typing import Any

RESTART_THE_RUN = ("trainer", "router", "inference")
"""Roles whose loss restarts the whole run from its last complete checkpoint, when it cannot be replaced
alone (an inference replica: only when its policy syncs by CUDA IPC)."""


class RestartBudget:
    """Restarts per role in a sliding window."""

    def __init__(self, max_restarts: int, window_s: float, clock=time.monotonic) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.clock = clock
        self._times: dict[str, deque[float]] = defaultdict(deque)

    def take(self, role: str) -> bool:
        """Use one restart of `role` if the window has one left (True), else False."""
        now = self.clock()
        times = self._times[role]
        while times and now - times[0] > self.window_s:
            times.popleft()
        if len(times) >= self.max_restarts:
            return False
        times.append(now)
        return True

    def used(self, role: str) -> int:
        """Restarts of `role` within the window."""
        return len(self._times[role])


RESTARTS_FILE = "restarts.jsonl"


class RunRestarts:
    """The whole-run restarts of one run: at most `max_total`, and each after the first only with progress."""

    def __init__(self, run_dir: Path, max_total: int) -> None:
        self.path = run_dir / RESTARTS_FILE
        self.max_total = max_total
        self.records: list[dict[str, Any]] = []
        """{"role", "died_at", "from_version"} of each restart so far, oldest first (earlier launchers' too)."""
        if self.path.exists():
            self.records = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def refusal(self, from_version: int) -> str | None:
        """Why the run may not restart from its checkpoint of `from_version` now, or None if it may."""
        if len(self.records) >= self.max_total:
            return f"the run has been restarted {len(self.records)} times, cluster.max_run_restarts={self.max_total}"
        if self.records and from_version <= self.records[-1]["from_version"]:
            return (
                f"the run was restarted from its checkpoint of version {self.records[-1]['from_version']} and lost a "
                "process again before it wrote a newer one: the fault recurs at the same point (data order and "
                "seeds are deterministic), and restarting again would repeat it"
            )
        return None

    def record(self, role: str, died_at: float, from_version: int) -> None:
        """A whole-run restart from `from_version` after losing a `role` process."""
        entry = {"role": role, "died_at": died_at, "from_version": from_version}
        self.records.append(entry)
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
