"""The env worker's side of leases (`cluster.leases`, docs/scale.md): which replica each Generate goes to.

The router leases each policy's live replicas to the env workers (`Lease`: the complete set, sent again
whenever it changes; router/leases.py). A worker holds a link to every leased replica (`direct_link.py`)
and sends each request straight to the leased replica of its policy with the fewest of this worker's
requests outstanding (ties in turn), and it balances only its own requests: the replicas' other load is
the other workers', which pick the same way. A policy whose lease is empty (none of its replicas is live
now) has its requests sent through the router, as without leases; the router holds them until a
replacement serves.

Every request is assigned to one place at a time, a replica or the router, and only its result from there
is taken. When a replica leaves a policy's lease (it was lost), the requests of that policy outstanding on
it are sent again, with their ids and deadlines, to another leased replica or through the router (counted
as `resent`); a result that comes later from the replica it left is dropped (counted as `stale`), as is any
result for a request that is no longer waited for. The counts go to the router with the worker's next
EpisodeDone (`take_counts`).

    client = LeaseClient(connect=make_link, via_router=peer.send_frames)
    client.update(Lease("p", [["inference/p/0", "tcp://10.0.0.2:40111"]]))
    client.submit(generate)                      # to inference/p/0
    client.accept("inference/p/0", request_id)   # True: its result is taken
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from mas_async.runtime.log_limit import LogLimit, printable
from mas_async.wire.messages import Generate, Lease, encode

log = logging.getLogger("mas_async.rollout.leases")

ROUTER = ""
"""Where a request sent through the router is assigned (no replica is named "")."""


class Link(Protocol):
    """A connection to one replica's direct socket."""

    endpoint: str

    def send(self, frames: list) -> None:
        """Queue an encoded message (never blocks the caller)."""

    def close(self) -> None:
        """Stop sending and receiving; what is queued is dropped."""


@dataclass
class _Request:
    policy: str
    frames: list
    replica: str
    """The replica it was sent to last, or ROUTER."""


def lease_error(lease: Lease) -> str:
    """ "" when every entry of `lease` is [replica name, tcp:// endpoint] with distinct names, else what is wrong."""
    names = set()
    for entry in lease.replicas:
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(v, str) for v in entry)):
            return "an entry is not [replica name, endpoint]"
        name, endpoint = entry
        if not name.startswith("inference/") or not endpoint.startswith("tcp://") or name in names:
            return "an entry is not [inference/<policy>/<i>, tcp://<address>:<port>] of a replica named once"
        names.add(name)
    return ""


class LeaseClient:
    """The leased replicas of each policy, the links to them, and where each outstanding request is."""

    def __init__(self, connect: Callable[[str, str], Link], via_router: Callable[[list], None]) -> None:
        self.connect = connect
        """(replica name, endpoint) -> a new link to it."""
        self.via_router = via_router
        """Send an encoded request through the router."""
        self.leases: dict[str, list[str]] = {}
        """Policy -> its leased replicas, in the router's order."""
        self.links: dict[str, Link] = {}
        """Replica -> the link to it (a replica in some policy's lease has one)."""
        self.outstanding: dict[str, int] = {}
        """Replica -> this worker's requests assigned to it."""
        self.requests: dict[int, _Request] = {}
        """Request id -> the request waited for, and where it is."""
        self._turn: dict[str, int] = {}
        """Policy -> where the next search of its lease starts (ties go round)."""
        self.direct = 0
        """Requests sent straight to a replica since `take_counts` (re-sent ones included)."""
        self.resent = 0
        """Requests sent again since `take_counts`: their replica left the lease (or was replaced)."""
        self.stale = 0
        """Results dropped since `take_counts`: their request was no longer there, or no longer waited for."""
        self.refused = 0
        """Leases dropped because an entry was malformed (logged, rate-limited)."""
        self._warnings = LogLimit()

    # -- the router's word -------------------------------------------------------------------------

    def update(self, lease: Lease) -> None:
        """Take `lease`, the complete set of `lease.policy`'s replicas now: connect to those new to this worker,
        send again every request outstanding on a replica that is no longer in its policy's lease, close the
        links no lease holds any longer. A replica whose endpoint changed is a new process (a replacement):
        what was outstanding on the old one goes again, whatever its policy."""
        if why := lease_error(lease):
            self.refused += 1
            if n := self._warnings.due(why):
                log.warning("dropped a lease of %s (%d so far): %s", printable(lease.policy), n, why)
            return
        new = dict((name, endpoint) for name, endpoint in lease.replicas)
        left = [name for name in self.leases.get(lease.policy, []) if name not in new]
        self.leases[lease.policy] = list(new)
        moved = {name for name, endpoint in new.items() if name in self.links and self.links[name].endpoint != endpoint}
        for policy, names in self.leases.items():  # (the other policies' leases name the process that is gone)
            if policy != lease.policy:
                names[:] = [name for name in names if name not in moved]
        again = [
            request
            for request in self.requests.values()
            if request.replica != ROUTER
            and (request.replica in moved or request.replica not in self.leases.get(request.policy, ()))
        ]
        for request in again:
            self.outstanding[request.replica] -= 1
            request.replica = ROUTER
        held = {name for names in self.leases.values() for name in names}
        for name in [name for name in self.links if name in moved or name not in held]:
            self.links.pop(name).close()
            del self.outstanding[name]
        for name, endpoint in new.items():
            if name not in self.links:
                self.links[name] = self.connect(name, endpoint)
                self.outstanding[name] = 0
        for request in again:
            self.resent += 1
            self._assign(request)
        if left or moved or again:
            log.info("lease of %s: %d replicas (%s left, %s replaced); %d requests sent again", lease.policy,
                     len(new), left, sorted(moved), len(again))  # fmt: skip

    # -- requests ----------------------------------------------------------------------------------

    def submit(self, msg: Generate) -> None:
        """Send a request to the least-busy leased replica of its policy, or through the router."""
        request = _Request(msg.policy, encode(msg), ROUTER)
        self.requests[msg.request_id] = request
        self._assign(request)

    def _assign(self, request: _Request) -> None:
        """Send `request` (assigned nowhere) to where `pick` says."""
        replica = self.pick(request.policy)
        request.replica = replica
        if replica == ROUTER:
            self.via_router(request.frames)
            return
        self.outstanding[replica] += 1
        self.direct += 1
        self.links[replica].send(request.frames)

    def pick(self, policy: str) -> str:
        """The leased replica of `policy` with the fewest of this worker's requests outstanding, the first
        from where the last search stopped among equals; ROUTER when none is leased."""
        names = self.leases.get(policy)
        if not names:
            return ROUTER
        start = self._turn.get(policy, 0) % len(names)
        best = min(range(len(names)), key=lambda i: (self.outstanding[names[(start + i) % len(names)]], i))
        chosen = (start + best) % len(names)
        self._turn[policy] = chosen + 1
        return names[chosen]

    def accept(self, source: str, request_id: int) -> bool:
        """Whether a result from `source` (a replica, or ROUTER) is taken: its request is waited for and
        assigned there; otherwise it is dropped and counted as stale."""
        request = self.requests.get(request_id)
        if request is None or request.replica != source:
            self.stale += 1
            return False
        return True

    def forget(self, request_id: int) -> None:
        """The request is no longer waited for (its result came, or its caller gave up)."""
        request = self.requests.pop(request_id, None)
        if request is not None and request.replica != ROUTER:  # (a replica with requests has its link)
            self.outstanding[request.replica] -= 1

    def take_counts(self) -> dict[str, int]:
        """What happened since the last call, for the next EpisodeDone (`EpisodeDone.leases`)."""
        counts = {"direct": self.direct, "resent": self.resent, "stale": self.stale}
        self.direct = self.resent = self.stale = 0
        return counts
