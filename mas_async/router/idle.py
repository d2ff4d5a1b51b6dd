"""Idle time of the inference side, as the router sees it: stretches with no episode in flight."""

from __future__ import annotations


class IdleTimer:
    """Accumulates the time during which `busy` was False, between calls of `update` and `take`."""

    def __init__(self, now: float) -> None:
        self._since = now
        self._busy = False
        self._idle = 0.0

    def update(self, now: float, *, busy: bool) -> None:
        """Record the state from `now` on (the state before `now` is the previous one's)."""
        if not self._busy:
            self._idle += now - self._since
        self._since, self._busy = now, busy

    def take(self, now: float, *, busy: bool) -> float:
        """The idle seconds since the last `take`; starts counting afresh."""
        self.update(now, busy=busy)
        idle, self._idle = self._idle, 0.0
        return idle
