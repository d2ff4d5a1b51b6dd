"""The env worker's lease client (`cluster.leases`), with fake links that record what was sent where: each
request goes to the leased replica with the fewest of this worker's requests outstanding (equals in turn),
through the router while a policy has none leased; when a replica leaves the lease (or is replaced, a new
endpoint) its outstanding requests go again elsewhere, and a late result from it is dropped and counted."""

from __future__ import annotations

import numpy as np

from mas_async.rollout.leases import ROUTER, LeaseClient
from mas_async.wire.messages import Generate, Lease, decode

A, B, C = "inference/vertical/0", "inference/vertical/1", "inference/vertical/2"


class _Link:
    def __init__(self, name: str, endpoint: str, log: list) -> None:
        self.name, self.endpoint, self.log, self.closed = name, endpoint, log, False

    def send(self, frames: list) -> None:
        assert not self.closed
        self.log.append((self.name, decode(frames).request_id))

    def close(self) -> None:
        self.closed = True


class _Client(LeaseClient):
    """A lease client whose links and router record (where, request id) in `sent`."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []
        self.made: list[_Link] = []
        super().__init__(
            connect=self._connect, via_router=lambda frames: self.sent.append((ROUTER, decode(frames).request_id))
        )

    def _connect(self, name: str, endpoint: str) -> _Link:
        link = _Link(name, endpoint, self.sent)
        self.made.append(link)
        return link

    def request(self, request_id: int, policy: str = "vertical") -> str:
        """Submit request `request_id`; where it went."""
        self.submit(Generate(request_id, policy, "env_worker/0", 1e12, np.arange(3, dtype=np.int32), 1, 4, 1.0, 1.0,
                             False, []))  # fmt: skip
        where, sent_id = self.sent[-1]
        assert sent_id == request_id
        return where


def _lease(*names: str, policy: str = "vertical", port: int = 7000) -> Lease:
    return Lease(policy, [[name, f"tcp://127.0.0.1:{port + int(name[-1])}"] for name in names])


def test_each_request_goes_to_the_leased_replica_with_the_fewest_outstanding():
    client = _Client()
    client.update(_lease(A, B, C))
    assert [link.name for link in client.made] == [A, B, C]  # connected at once
    assert [client.request(i) for i in range(6)] == [A, B, C, A, B, C]  # equals in turn
    for request_id in (1, 4):  # B's two requests are answered
        assert client.accept(B, request_id)
        client.forget(request_id)
    assert client.outstanding == {A: 2, B: 0, C: 2}
    assert [client.request(i) for i in (10, 11)] == [B, B]  # the least busy first, until it is not
    assert client.request(12) == C  # then in turn among the equals, from the one after the last chosen
    assert client.take_counts() == {"direct": 9, "resent": 0, "stale": 0}
    assert client.take_counts() == {"direct": 0, "resent": 0, "stale": 0}  # counted once


def test_a_policy_without_a_leased_replica_sends_through_the_router():
    client = _Client()
    assert client.request(1) == ROUTER  # no lease yet
    client.update(_lease(A))
    assert client.request(2) == A and client.request(3, policy="horizontal") == ROUTER
    assert client.accept(ROUTER, 1) and not client.accept(A, 1)  # a request's result comes from where it is


def test_a_lost_replica_s_outstanding_requests_go_again_and_its_late_results_are_dropped():
    client = _Client()
    client.update(_lease(A, B))
    for request_id in range(4):
        client.request(request_id)  # A: 0, 2; B: 1, 3
    assert client.accept(A, 0)
    client.forget(0)  # answered before the loss
    client.sent.clear()
    client.update(_lease(B))  # A was lost
    assert client.sent == [(B, 2)] and client.outstanding == {B: 3}
    assert [link.closed for link in client.made] == [True, False]  # no lease holds A: its link is closed
    assert not client.accept(A, 2)  # A's late result: the request is B's now
    assert client.accept(B, 2)
    client.sent.clear()
    client.update(_lease())  # B lost too: what it had goes through the router (which holds it for a replacement)
    assert sorted(client.sent) == [(ROUTER, 1), (ROUTER, 2), (ROUTER, 3)] and client.outstanding == {}
    assert not client.accept(B, 3) and client.accept(ROUTER, 3)
    assert client.take_counts() == {"direct": 5, "resent": 4, "stale": 2}
    client.update(_lease(A, port=8000))  # A's replacement, at its own endpoint: a new link
    assert client.made[-1].endpoint == "tcp://127.0.0.1:8000" and client.request(20) == A
    assert client.accept(ROUTER, 1)  # what went through the router stays there


def test_a_replica_replaced_at_a_new_endpoint_has_its_requests_sent_again_whatever_their_policy():
    """A replica that serves two policies (a shared base): its replacement (a new endpoint) comes in one
    policy's lease first; every request on the process that is gone goes again, and the other policy's
    lease no longer names it until its own lease comes."""
    client = _Client()
    client.update(_lease(A))
    client.update(_lease(A, policy="horizontal"))
    assert client.request(1) == A and client.request(2, policy="horizontal") == A and len(client.made) == 1
    client.sent.clear()
    client.update(_lease(A, port=8000))
    assert client.made[0].closed and client.made[1].endpoint == "tcp://127.0.0.1:8000"
    assert sorted(client.sent) == [(ROUTER, 2), (A, 1)]  # horizontal has no replica leased until its lease comes
    assert client.leases == {"vertical": [A], "horizontal": []} and client.outstanding == {A: 1}


def test_a_malformed_lease_is_dropped_and_counted():
    client = _Client()
    client.update(_lease(A))
    for replicas in ([["inference/vertical/0"]], [[A, "ipc:///tmp/x"]], [["trainer/vertical", "tcp://h:1"]],
                     [[A, "tcp://h:1"], [A, "tcp://h:2"]], ["tcp://h:1"]):  # fmt: skip
        client.update(Lease("vertical", replicas))
    assert client.refused == 5 and client.leases == {"vertical": [A]} and len(client.made) == 1
