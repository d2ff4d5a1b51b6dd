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
    assert table.all_joined() and table.least_loaded_worker() == b"env_worker/0"
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


def _workers_table(count: int, capacity: int) -> tuple[PeerTable, list[bytes]]:
    names = [f"env_worker/{i}".encode() for i in range(count)]
    table = PeerTable({n.decode() for n in names})
    for i, name in enumerate(names):
        table.join(name, PeerInfo("env_worker", "", capacity, i))
    return table, names


def test_the_least_loaded_worker_is_always_one_a_scan_would_pick_as_workers_change_at_random():
    """Episodes start and end, last attempts take workers alone or reserve them, workers die and join again: the
    table's pick always has room and the fewest episodes in flight of the workers that take episodes (the
    definition, `takes_episodes`, checked by a scan), and is None exactly when none has room."""
    rng = random.Random(0)
    table, names = _workers_table(30, 4)
    running: list[tuple[bytes, bool]] = []  # (worker, alone) of every episode in flight

    def check() -> None:
        room = [table.peers[n].outstanding for n in names if table.takes_episodes(table.peers[n])]
        chosen = table.least_loaded_worker()
        if not room:
            assert chosen is None
        else:
            assert chosen is not None and table.takes_episodes(table.peers[chosen])
            assert table.peers[chosen].outstanding == min(room)

    for _ in range(4000):
        action = rng.random()
        if action < 0.45:
            worker = table.least_loaded_worker()
            if worker is not None:
                table.episode_started(worker)
                running.append((worker, False))
        elif action < 0.85 and running:
            worker, alone = running.pop(rng.randrange(len(running)))
            if table.peers[worker].alive:
                table.episode_ended(worker, alone)
        elif action < 0.9:
            worker = table.worker_for_alone()
            check()  # (the worker it takes, or reserves, no longer takes episodes)
            if worker is not None:
                table.episode_started(worker)
                running.append((worker, True))
        elif action < 0.95:
            table.mark_dead(rng.choice(names))
        else:  # a replacement joins under a dead worker's name, with nothing in flight
            dead = [n for n in names if not table.peers[n].alive]
            if dead:
                name = rng.choice(dead)
                running = [(w, a) for w, a in running if w != name]
                table.join(name, PeerInfo("env_worker", "", 4, 99))
        check()


def test_refilling_a_slot_does_not_scan_the_workers(monkeypatch):
    """With 1,024 env workers, starting and ending 2,000 episodes looks at a handful of workers each, not at all
    of them (a scan per episode cost ~0.1 us a worker: 111 us at 1,024 workers)."""
    table, _ = _workers_table(1024, 4)
    looked = 0
    takes = PeerTable.takes_episodes

    def counted(info: PeerInfo) -> bool:
        nonlocal looked
        looked += 1
        return takes(info)

    monkeypatch.setattr(PeerTable, "takes_episodes", staticmethod(counted))
    for _ in range(2000):
        worker = table.least_loaded_worker()
        assert worker is not None
        table.episode_started(worker)
        table.episode_ended(worker, False)
    assert looked <= 2 * 2000, looked
