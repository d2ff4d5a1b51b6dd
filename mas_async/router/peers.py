"""The router's table of peers: who joined, who is alive, and which inference replica serves next.

Every peer says Hello once (a repeated Hello replaces its entry) and sends a message at least every
`heartbeat_s` (a Heartbeat when it has nothing else to send; the router stamps `last_seen` on each);
`silent(now, timeout)` names the peers that stopped. The replicas routed each policy are
kept by requests in flight (`least_loaded.py`), so the hot path picks the least-loaded one without
scanning any; a replica that serves several policies (a shared base, `policies.<p>.base`) is listed under
each. The env workers with room for another episode are kept by episodes in flight the same way, so
refilling a slot does not scan every worker (a scan cost ~0.1 us a worker per episode: bench/router_refill.py).
A worker's episodes in flight and its part in a last attempt change only through the table's methods.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mas_async.router.least_loaded import LeastLoaded


@dataclass
class PeerInfo:
    role: str
    policy: str
    capacity: int
    pid: int
    last_seen: float = field(default_factory=time.monotonic)
    outstanding: int = 0
    """Inference: requests in flight. Env worker: episodes in flight."""
    alive: bool = True
    policies: tuple[str, ...] = ()
    """Every policy it serves: an inference replica's own, then those that share its base; () means (policy,)."""
    routed: set[str] = field(default_factory=set)
    """Inference: the policies whose requests the router sends it (a replacement gets each one only once it
    loaded that policy's current weights)."""
    exclusive: bool = False
    """Env worker: it runs an episode's last attempt, alone (no other episode is dispatched to it)."""
    reserved: bool = False
    """Env worker: it takes no new episodes until it is idle, then runs a last attempt alone."""

    def __post_init__(self) -> None:
        self.policies = self.policies or (self.policy,)


class PeerTable:
    """Peers by socket identity, with the live replicas of each policy and the env workers."""

    def __init__(self, expected: set[str]) -> None:
        self.expected = expected
        """Names ("router"-side identities) of every peer the deployment must have."""
        self.peers: dict[bytes, PeerInfo] = {}
        self._replicas: dict[str, LeastLoaded] = {}
        self._workers: dict[bytes, PeerInfo] = {}
        self._free = LeastLoaded()
        """The env workers that take episodes (`takes_episodes`), by episodes in flight."""
        self._missing = set(expected)

    def join(self, identity: bytes, info: PeerInfo, serving: bool = True) -> None:
        """Add a peer (a repeated Hello replaces its entry); a replica takes requests at once if `serving`,
        else policy by policy as `serve` is called."""
        self.peers[identity] = info
        self._missing.discard(identity.decode("utf-8", "replace"))
        if info.role == "env_worker":
            self._workers[identity] = info
            self._refile(identity)
        elif info.role == "inference":
            for policy in info.policies:
                self._replicas.setdefault(policy, LeastLoaded()).remove(identity)
                if serving:
                    self.serve(identity, policy)

    def serve(self, identity: bytes, policy: str) -> bool:
        """Start routing `policy`'s requests to replica `identity` (a replacement that loaded its current
        weights); False if it already does or is not alive."""
        info = self.peers[identity]
        if policy in info.routed or not info.alive:
            return False
        info.routed.add(policy)
        self._replicas.setdefault(policy, LeastLoaded()).add(identity, info.outstanding)
        return True

    def routed_replicas(self, policy: str) -> list[bytes]:
        """The replicas that `policy`'s requests go to, least-loaded first."""
        replicas = self._replicas.get(policy)
        return replicas.members() if replicas is not None else []

    def all_joined(self) -> bool:
        return not self._missing

    def all_joined_but(self, names: set[str]) -> bool:
        """Whether every expected peer but those of `names` joined."""
        return self._missing <= names

    def missing(self) -> list[str]:
        return sorted(self._missing)

    def pick_replica(self, policy: str) -> tuple[bytes, PeerInfo] | None:
        """The live replica of `policy` with the fewest outstanding requests (None if it has none)."""
        replicas = self._replicas.get(policy)
        chosen = replicas.least() if replicas is not None else None
        return None if chosen is None else (chosen, self.peers[chosen])

    def set_outstanding(self, identity: bytes, requests: int) -> None:
        """Replica `identity` has `requests` in flight (what `pick_replica` balances by)."""
        info = self.peers[identity]
        info.outstanding = requests
        for policy in info.routed:
            self._replicas[policy].add(identity, requests)

    def live_workers(self) -> list[bytes]:
        """Every live env worker."""
        return [ident for ident, info in self._workers.items() if info.alive]

    def least_loaded_worker(self) -> bytes | None:
        """The live env worker with room for another episode and the fewest in flight (None: none has room)."""
        return self._free.least()

    def episode_started(self, identity: bytes) -> None:
        """Env worker `identity` was sent an episode."""
        self.peers[identity].outstanding += 1
        self._refile(identity)

    def episode_ended(self, identity: bytes, alone: bool) -> None:
        """An episode of env worker `identity` ended (`alone`: a last attempt, which it ran alone)."""
        info = self.peers[identity]
        info.outstanding -= 1
        if alone:
            info.exclusive = False
        self._refile(identity)

    def _refile(self, identity: bytes) -> None:
        """Keep `_free` up to date after env worker `identity` changed."""
        info = self._workers.get(identity)
        if info is not None and self.takes_episodes(info):
            self._free.add(identity, info.outstanding)
        else:
            self._free.remove(identity)

    @staticmethod
    def takes_episodes(info: PeerInfo) -> bool:
        """A live env worker with room, not running or waiting to run a last attempt alone."""
        room = info.outstanding < info.capacity and not (info.exclusive or info.reserved)
        return info.role == "env_worker" and info.alive and room

    def worker_for_alone(self) -> bytes | None:
        """A live env worker to run an episode alone on: an idle one (it becomes exclusive), or None while
        there is none; then the least-loaded one is reserved (it takes no new episodes) until it is idle."""
        workers = [(info.outstanding, ident) for ident, info in self._workers.items()
                   if info.alive and not info.exclusive]  # fmt: skip
        idle = [ident for outstanding, ident in workers if outstanding == 0]
        if idle:
            for _, ident in workers:  # (a reservation is for the next last attempt to wait: it asks again)
                self.peers[ident].reserved = False
                self._refile(ident)
            self.peers[idle[0]].exclusive = True
            self._refile(idle[0])
            return idle[0]
        if workers and not any(self.peers[ident].reserved for _, ident in workers):
            reserved = min(workers)[1]
            self.peers[reserved].reserved = True
            self._refile(reserved)
        return None

    def silent(self, now: float, timeout_s: float) -> list[tuple[bytes, PeerInfo]]:
        return [(i, p) for i, p in self.peers.items() if p.alive and now - p.last_seen > timeout_s]

    def mark_dead(self, identity: bytes) -> PeerInfo:
        info = self.peers[identity]
        info.alive = False
        info.routed.clear()
        self._refile(identity)
        if info.role == "inference":
            for policy in info.policies:
                if (replicas := self._replicas.get(policy)) is not None:
                    replicas.remove(identity)
        return info

    def of_policy(self, role: str, policy: str, alive: bool = False) -> list[bytes]:
        """Identities of the peers of `role` that serve `policy` (only the live ones with `alive`)."""
        return [i for i, p in self.peers.items() if p.role == role and policy in p.policies and (p.alive or not alive)]
