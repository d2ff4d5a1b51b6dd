"""The router's balancer: the least-loaded replica in O(1), however loads move."""

import random

from mas_async.router.least_loaded import LeastLoaded
from mas_async.router.peers import PeerInfo, PeerTable


def test_least_is_a_member_of_the_lowest_load_as_loads_move_at_random():
    rng = random.Random(0)
    balancer, loads = LeastLoaded(), {}
    for step in range(3000):
        member = f"r{rng.randrange(40)}".encode()
        action = rng.random()
        if action < 0.1:
            balancer.remove(member)
            loads.pop(member, None)
        else:
            load = max(0, loads.get(member, 0) + rng.choice((-1, 1, 1)))
            balancer.add(member, load)
            loads[member] = load
        chosen = balancer.least()
        if not loads:
            assert chosen is None
            continue
        assert loads[chosen] == min(loads.values()), step
        assert len(balancer) == len(loads) and sorted(balancer.members()) == sorted(loads)


def test_among_equal_loads_the_first_to_reach_the_load_is_chosen():
    balancer = LeastLoaded()
    for member in (b"a", b"b", b"c"):
        balancer.add(member, 0)
    balancer.add(b"a", 1)
    balancer.add(b"b", 1)
    assert balancer.least() == b"c"
    balancer.add(b"c", 1)
    assert balancer.least() == b"a" and balancer.members() == [b"a", b"b", b"c"]
    balancer.add(b"b", 0)
    assert balancer.least() == b"b"


def test_the_table_balances_a_thousand_replicas_by_requests_in_flight():
    names = {f"inference/p/{i}" for i in range(1000)} | {"env_worker/0"}
    table = PeerTable(names)
    for i in range(1000):
        table.join(f"inference/p/{i}".encode(), PeerInfo("inference", "p", 8, i))
    assert not table.all_joined() and table.missing() == ["env_worker/0"]
    table.join(b"env_worker/0", PeerInfo("env_worker", "", 4, 1000))
    assert table.all_joined() and table.free_workers() == [(0, b"env_worker/0")]
    chosen = []
    for _ in range(2500):  # every replica takes 2 requests before any takes a third
        ident, info = table.pick_replica("p")
        table.set_outstanding(ident, info.outstanding + 1)
        chosen.append(ident)
    counts = sorted(table.peers[f"inference/p/{i}".encode()].outstanding for i in range(1000))
    assert counts[0] == 2 and counts[-1] == 3 and len(set(chosen[:1000])) == 1000
    table.set_outstanding(b"inference/p/7", 0)
    assert table.pick_replica("p")[0] == b"inference/p/7"
    table.mark_dead(b"inference/p/7")
    assert table.pick_replica("p")[0] != b"inference/p/7" and b"inference/p/7" not in table.routed_replicas("p")
