"""The replicas of one policy by requests in flight, so the router's hot path finds the least-loaded one in
O(1) however many replicas a policy has (a scan per request costs tens of microseconds at 1,024)."""

from __future__ import annotations


class LeastLoaded:
    """Members by load, in buckets of equal load; among the least-loaded, the one that reached its load first."""

    def __init__(self) -> None:
        self._load: dict[bytes, int] = {}
        self._buckets: dict[int, dict[bytes, None]] = {}
        self._low = 0
        """At most the lowest load of a member (the lowest bucket is found from here, upwards)."""

    def __len__(self) -> int:
        return len(self._load)

    def __contains__(self, member: bytes) -> bool:
        return member in self._load

    def members(self) -> list[bytes]:
        """Every member, least-loaded first."""
        return [m for load in sorted(self._buckets) for m in self._buckets[load]]

    def add(self, member: bytes, load: int) -> None:
        """Add `member` at `load` (moving it there if it is a member)."""
        self.remove(member)
        self._low = load if not self._load else min(self._low, load)
        self._load[member] = load
        self._buckets.setdefault(load, {})[member] = None

    def remove(self, member: bytes) -> None:
        load = self._load.pop(member, None)
        if load is None:
            return
        bucket = self._buckets[load]
        del bucket[member]
        if not bucket:
            del self._buckets[load]

    def least(self) -> bytes | None:
        """The member with the lowest load (None if there is none)."""
        if not self._load:
            return None
        while self._low not in self._buckets:
            self._low += 1
        return next(iter(self._buckets[self._low]))
