"""Who is in each policy's weight group, generation after generation: the router's side of re-forming it.

A policy's weight group (`weights/group.py`) is its trainer (rank 0) and the replicas that serve it. Its
first generation holds every replica of the deployment. The router changes it as soon as it learns of a
change, and only then:
- a replica is lost (the launcher found it dead, its replacement said Hello, or it fell silent): the next
  generation is the live members without it, so the trainer's sends go on reaching them while the
  replacement loads its model, however long that takes;
- a replacement is ready (it said Hello, which it does once its model is loaded): the next generation is
  the members with it, and the replacement catches up first, alone with the trainer in a generation of
  their own (the one before: `ReformWeightGroup.fresh`), where the trainer sends it the version the others
  hold; they receive nothing and keep serving while the groups form.
Each change is a `ReformWeightGroup` order to the trainer and to the members. A replacement stays in
`catching_up` until it reports the version the others hold (the router routes it requests from then on);
an order made meanwhile lets it catch up again, so no order that supersedes another loses a catch-up.
"""

from __future__ import annotations

from mas_async.wire.messages import ReformWeightGroup


def replica_index(name: str) -> int:
    """The index of an inference replica by its name: "inference/p/2" -> 2."""
    return int(name.rsplit("/", 1)[1])


class WeightGroups:
    """The members and generation of every policy's weight group."""

    def __init__(self, replicas: dict[str, int]) -> None:
        """`replicas`: policy -> how many replicas serve it (its base's, on a shared base)."""
        self.members = {policy: list(range(n)) for policy, n in replicas.items()}
        """policy -> replica indices of its current generation, in rank order (rank 1 + position)."""
        self.generations = dict.fromkeys(replicas, 0)
        self.catching_up: dict[str, set[int]] = {policy: set() for policy in replicas}
        """policy -> replacements that are members but do not hold the policy's current version yet."""
        self.orders: dict[str, ReformWeightGroup] = {}
        """policy -> the newest order (none while the first generation holds)."""

    def remove(self, policy: str, replica: int) -> ReformWeightGroup | None:
        """Replica `replica` is lost: the order of a generation without it (None if it was no member)."""
        self.catching_up[policy].discard(replica)
        if replica not in self.members[policy]:
            return None
        return self._order(policy, [m for m in self.members[policy] if m != replica])

    def add(self, policy: str, replica: int) -> ReformWeightGroup:
        """Replacement `replica` is ready: the order of a generation with it, which it catches up to first."""
        self.catching_up[policy].add(replica)
        return self._order(policy, sorted({*self.members[policy], replica}))

    def caught_up(self, policy: str, replica: int) -> None:
        """Replica `replica` reported the policy's current version: it is served requests from now on."""
        self.catching_up[policy].discard(replica)

    def _order(self, policy: str, members: list[int]) -> ReformWeightGroup:
        fresh = sorted(self.catching_up[policy] & set(members))
        # A catch-up takes the generation before the new one: generations only grow, each prefix used once.
        self.generations[policy] += 2 if fresh else 1
        self.members[policy] = members
        order = ReformWeightGroup(policy, self.generations[policy], members, fresh)
        self.orders[policy] = order
        return order
