"""The router's side of leases (`cluster.leases`, docs/scale.md): which inference replicas each env worker
sends its Generates to directly, and what the workers report of that data path.

The router keeps the control plane (versions, the update gate, episodes, weight groups, membership); with
leases the requests and their results go between the env workers and the replicas without it. A replica
says its direct endpoint in its Hello. A worker's share of a policy's replicas is fixed by the two counts
(`share`): `cluster.lease_replicas` of them, or ceil(replicas / workers) if that is more, consecutive in the
ring of the replicas from the worker's own place in it, so every replica is leased to as many workers as
any other. Its lease is the replicas of its share that the router would route to itself
(`PeerTable.routed_replicas`: alive, and holding the weights the others serve), each with its endpoint, in
name order. Every env worker receives its lease of each policy when the run starts (or when it joins
later), and again whenever it changes: a replica of its share is lost, or it (or its replacement, once
caught up) serves. Nothing is sent before the run starts: no episode runs then, and a
thousand replicas saying Hello one by one would otherwise send every worker a thousand growing leases.

Strict on-policy does not depend on the router seeing the requests: it still starts an iteration's
episodes only once every leased replica holds the iteration's version, a replacement is leased only once
it holds the version the others serve, and every sample carries its version, which its trainer checks.

The workers' counts come with their EpisodeDone (`EpisodeDone.leases`, since the worker's previous one):
Generates sent directly, requests of a replica that left the lease sent again (`faults/reissued_requests`,
with those the router re-sent itself), and results dropped because their request was no longer that
replica's. They are in the first row written after the EpisodeDone that brought them (with bounded
staleness, episodes of the next iteration may bring some).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from mas_async.metrics import Keys
from mas_async.router.membership import replica_index
from mas_async.wire.messages import Lease, Trainers

if TYPE_CHECKING:
    from mas_async.router.peers import PeerTable

COUNTS = ("direct", "resent", "stale")
"""The keys of an EpisodeDone's lease counts."""
MAX_ENDPOINT = 256
"""The longest endpoint a replica may say in its Hello (tcp://, an address, a port)."""


def endpoint_error(endpoint: str) -> str:
    """ "" when `endpoint` is one a replica can give ("tcp://<address>:<port>"), else what is wrong with it."""
    if not endpoint.startswith("tcp://") or len(endpoint) > MAX_ENDPOINT or not endpoint.isprintable():
        return "its endpoint is not tcp://<address>:<port> (cluster.leases is on)"
    return ""


def share(worker: int, workers: int, replicas: int, size: int) -> set[int]:
    """The indices of the replicas leased to env worker `worker` of `workers`, of a policy's `replicas`:
    `size` of them, or ceil(replicas / workers) if that is more (all, if fewer), consecutive in the ring of
    the replicas from the worker's place in it (worker * replicas // workers)."""
    count = min(replicas, max(size, math.ceil(replicas / max(workers, 1))))
    start = worker * replicas // max(workers, 1)
    return {(start + i) % replicas for i in range(count)}


class LeaseBook:
    """The endpoints of the replicas, the leases last sent, and the workers' counts since the last row."""

    def __init__(self, replicas: dict[str, int], workers: int, size: int) -> None:
        self.replicas = replicas
        """Policy -> how many replicas serve it (its server policy's)."""
        self.policies = list(replicas)
        self.workers = workers
        self.size = size
        self.endpoints: dict[bytes, str] = {}
        """Replica -> its direct endpoint (from its latest Hello)."""
        self.sent: dict[tuple[bytes, str], list[list[str]]] = {}
        """(worker, policy) -> the replicas of the lease the worker holds: [[name, endpoint], ...]."""
        self.started = False
        """Whether the run started (leases are sent from then on)."""
        self.direct = 0
        """Generates the workers sent straight to a replica, since the last row."""
        self.stale = 0
        """Results the workers dropped (their request was no longer that replica's), since the last row."""
        self.trainers: dict[str, str] = {}
        """Trainer name -> its direct endpoint (from its Hello): where the env workers send their Groups."""
        self.groups = 0
        """Groups the workers sent straight to a trainer that the router accepted, since the last row."""

    def joined(self, replica: bytes, endpoint: str) -> None:
        self.endpoints[replica] = endpoint

    def trainers_message(self) -> Trainers:
        """Every trainer's endpoint, for an env worker."""
        return Trainers(sorted([name, endpoint] for name, endpoint in self.trainers.items()))

    def serving(self, table: PeerTable, policy: str) -> dict[int, bytes]:
        """`policy`'s replicas that the router would route to and whose endpoint it knows, by index."""
        return {replica_index(r.decode()): r for r in table.routed_replicas(policy) if r in self.endpoints}

    def lease(self, policy: str, worker: bytes, serving: dict[int, bytes]) -> Lease:
        """`worker`'s lease of `policy` now: the replicas of its share among `serving` (`serving()`), with their
        endpoints, in name order."""
        place = int(worker.decode().rsplit("/", 1)[1])  # env_worker/<place>
        mine = [serving[i] for i in share(place, self.workers, self.replicas[policy], self.size) if i in serving]
        return Lease(policy, sorted([ident.decode(), self.endpoints[ident]] for ident in mine))

    def every(self, table: PeerTable, worker: bytes) -> list[Lease]:
        """Every policy's lease of `worker` (for a worker that joins; recorded as sent)."""
        leases = [self.lease(policy, worker, self.serving(table, policy)) for policy in self.policies]
        self.sent.update(((worker, lease.policy), lease.replicas) for lease in leases)
        return leases

    def changed(self, table: PeerTable, workers: list[bytes]) -> list[tuple[bytes, Lease]]:
        """(worker, lease) of the leases of `workers` that differ from those sent last (recorded as sent)."""
        changed = []
        for policy in self.policies:
            serving = self.serving(table, policy)
            for worker in workers:
                lease = self.lease(policy, worker, serving)
                if lease.replicas != self.sent.get((worker, policy)):
                    self.sent[(worker, policy)] = lease.replicas
                    changed.append((worker, lease))
        return changed

    def count(self, counts: dict[str, Any], most: int) -> bool:
        """Add a worker's direct and stale counts (`EpisodeDone.leases`; its "resent" is the fault log's);
        False, nothing added, unless each is a known key with an int in 0..`most`."""
        if not all(key in COUNTS and type(value) is int and 0 <= value <= most for key, value in counts.items()):
            return False
        self.direct += counts.get("direct", 0)
        self.stale += counts.get("stale", 0)
        return True

    def take(self) -> dict[str, int]:
        """This row's leases/* metrics; counting starts again from zero."""
        row = {Keys.DIRECT_REQUESTS: self.direct, Keys.STALE_RESULTS: self.stale, Keys.DIRECT_GROUPS: self.groups}
        self.direct = self.stale = self.groups = 0
        return row
