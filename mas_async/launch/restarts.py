"""How many lost processes the launcher may still replace: `cluster.max_restarts` per role within
`cluster.restart_window_s`.

An env worker or an inference replica is replaced alone (the router sends its episodes or requests
elsewhere meanwhile, and re-forms a replica's weight group; `router.faults.replaced_alone` says which).
A lost trainer or router cannot be replaced alone (the weights it held or the books it kept are gone),
so the launcher restarts the whole run from its last complete checkpoint instead (docs/faults.md).
A role that keeps
dying within the window uses up its budget, and the run then stops with the failure named, as it would
without restarts.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque

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
