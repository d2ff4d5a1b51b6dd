"""Rate-limited warnings: a flood of one event writes a few log lines with counts, not a line per event.

A malformed message, a message from a sender that never joined, a refused handshake, a send to a vanished
peer: each may come by the thousand (a fuzzer, a client in a retry loop, a misconfigured process), and a
log with one line per event hides everything else. `LogLimit.due(key)` counts every occurrence of `key`
and says when one is worth a line: the 1st, 2nd, 4th, 8th, ... and, for a trickle that goes on, at least
every `interval_s` seconds; so n events write about log2(n) lines, each carrying the count so far.
Keys must come from a small set (a reason, a message kind), never from what a sender chooses (its
identity): each key is a counter kept for the life of the process.

`printable(identity)` renders bytes that a sender chose (a socket identity) for a log line: ASCII,
control and other bytes escaped, truncated.

    limit = LogLimit()
    if n := limit.due("malformed"):
        log.warning("dropped a malformed message from %s (%d so far): %s", printable(identity), n, error)
"""

from __future__ import annotations

import time
from collections.abc import Hashable

DEFAULT_INTERVAL_S = 60.0


class LogLimit:
    """Counts of each key, and whether its latest occurrence should be logged."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.counts: dict[Hashable, int] = {}
        self._logged_at: dict[Hashable, float] = {}

    def due(self, key: Hashable) -> int:
        """Count one occurrence of `key`; its count when this one should be logged (the 1st, 2nd, 4th,
        8th, ... or the first after `interval_s` without a line), else 0."""
        n = self.counts[key] = self.counts.get(key, 0) + 1
        now = time.monotonic()
        if n & (n - 1) == 0 or now - self._logged_at.get(key, now) >= self.interval_s:
            self._logged_at[key] = now
            return n
        return 0


def printable(identity: bytes | str, limit: int = 64) -> str:
    """`identity` as printable ASCII: invalid UTF-8 as \\xNN, control and non-ASCII characters escaped,
    cut to `limit` characters (then "...")."""
    text = identity.decode("utf-8", "backslashreplace") if isinstance(identity, bytes) else identity
    text = "".join(c if c.isascii() and c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return text if len(text) <= limit else text[:limit] + "..."
