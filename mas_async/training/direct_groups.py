"""A trainer's own socket for its samples (`cluster.leases`): env workers send each episode's Groups of the
trainer's policy straight to it, and they train only once the router accepted that episode.

The socket is a `DirectSocket` (runtime/direct_socket.py: bound on the trainer's node address, CURVE with
the trainer's own key, only env workers admitted, each as its process); its endpoint goes into the
trainer's Hello and the router tells every env worker (`Trainers`). The router still decides which
episodes count: when an episode is done it sends the trainer `Accepted` (episode, attempt, the worker that
ran it, its sample count) and counts those samples into the step's `expected_samples`. A Groups message
is delivered to the trainer's buffer when both are here, in either order, and only if it came from that
worker with that count; one that never gets accepted (an attempt abandoned when its worker was lost, a
timed-out episode, a failed one) is dropped when its iteration steps and counted (`unaccepted_samples`).
Anything else (another policy's groups, a second copy, groups of an iteration already stepped, a sender
that is not the worker the router named) is refused and counted, never trained on.

Every Groups message is answered (`GroupsReceived`: held, or refused and why), and the worker sends the
episode's EpisodeDone only after that answer: so the groups of every episode the router accepts are here
already, even if the worker is lost right after. Before its step the trainer still checks, with a bounded
wait that ends in a named error (`wait_for`), that every accepted episode of the iteration was delivered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import zmq.asyncio

from mas_async.runtime.direct_socket import DirectSocket, Spawn
from mas_async.wire.messages import Accepted, Groups, GroupsReceived, Message, encode

Key = tuple[int, str, int]
"""(iteration, episode id, attempt)."""


class MissingGroups(RuntimeError):
    """Groups of episodes the router accepted did not reach the trainer in time."""


class DirectGroups:
    """The trainer's direct socket, and the groups and acceptances waiting for each other."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        keys_dir: str | None,
        policy: str,
        deliver: Callable[[Groups], None],
        secret: str | None = None,
    ) -> None:
        self.socket = DirectSocket(ctx, address, keys_dir, self._on_message, secret, what="groups")
        self.policy = policy
        self.deliver = deliver
        """Hands an accepted episode's Groups to the trainer's buffer."""
        self.arrived: dict[Key, dict[str, Groups]] = {}
        """Groups that came before their acceptance: key -> sender -> message (a worker that was not named
        cannot keep the one that was from delivering)."""
        self.accepted: dict[Key, tuple[str, int]] = {}
        """Acceptances whose groups have not come yet: key -> (env worker, samples)."""
        self.stepped = -1
        """The last iteration stepped: what comes for it or earlier is refused."""
        self.delivered = 0
        """Groups messages delivered so far."""
        self.unaccepted = 0
        """Samples dropped so far because their episode was never accepted (counted when it stepped)."""
        self._changed = asyncio.Event()

    @property
    def refused(self) -> int:
        """Messages refused so far (`DirectSocket.refuse`): groups that do not train, and anything else."""
        return self.socket.refused

    def start(self, spawn: Spawn) -> str:
        """Bind and start receiving; returns the endpoint."""
        return self.socket.start(spawn)

    def _on_message(self, sender: str, route: bytes, msg: Message) -> None:
        if not isinstance(msg, Groups):
            self.socket.refuse(sender, f"a {type(msg).__name__} is not an episode's groups")
            return
        error = self._hold(sender, msg)
        if error:
            self.socket.refuse(sender, error)
        # The worker sends its EpisodeDone once it has this answer: the router accepts nothing not held here.
        self.socket.send(route, encode(GroupsReceived(msg.policy, msg.iteration, msg.episode_id, msg.attempt, error)))

    def _hold(self, sender: str, msg: Groups) -> str:
        """Hold (or deliver, if accepted already) an episode's groups; "" or why they were refused."""
        if msg.policy != self.policy:
            return "its policy is not this trainer's"
        if msg.iteration <= self.stepped:
            return "its iteration has stepped"
        key = (msg.iteration, msg.episode_id, msg.attempt)
        if key in self.accepted:
            return self._match(key, sender, msg)
        if sender in self.arrived.setdefault(key, {}):
            return "its episode's groups came already"
        self.arrived[key][sender] = msg
        return ""

    def on_accepted(self, msg: Accepted) -> None:
        """The router's word that these episodes are done and their groups train (checked by the caller: of
        this policy)."""
        for episode_id, attempt, worker, samples in msg.episodes:
            key = (msg.iteration, episode_id, attempt)
            self.accepted[key] = (worker, samples)
            held = self.arrived.pop(key, {})
            for sender in held:
                if sender != worker:
                    self.socket.refuse(sender, "its sender is not the env worker that ran the episode")
            if worker in held and (error := self._match(key, worker, held[worker])):
                self.socket.refuse(worker, error)

    def _match(self, key: Key, sender: str, msg: Groups) -> str:
        """Deliver the groups of an accepted episode; "" or why they were refused."""
        worker, samples = self.accepted[key]
        if sender != worker:
            return "its sender is not the env worker that ran the episode"
        if msg.n_samples != samples:
            return "its sample count is not the one its EpisodeDone gave"
        del self.accepted[key]
        self.delivered += 1
        self.deliver(msg)
        self._changed.set()
        return ""

    def missing(self, iteration: int) -> int:
        """Accepted episodes of `iteration` whose groups have not been delivered."""
        return sum(1 for key in self.accepted if key[0] == iteration)

    async def wait_for(self, iteration: int, timeout_s: float) -> None:
        """Wait until every accepted episode of `iteration` has its groups delivered; MissingGroups after
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while missing := self.missing(iteration):
            left = deadline - time.monotonic()
            if left <= 0:
                raise MissingGroups(
                    f"the groups of {missing} episodes of iteration {iteration} that the router accepted did not "
                    f"come from their env workers within {timeout_s:g}s"
                )
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                pass

    def stepped_through(self, iteration: int) -> int:
        """`iteration` steps now: drop the groups of it and earlier that were never accepted; returns how many
        samples they held (added to `unaccepted`)."""
        self.stepped = max(self.stepped, iteration)
        gone = [key for key in self.arrived if key[0] <= iteration]
        dropped = sum(groups.n_samples for key in gone for groups in self.arrived.pop(key).values())
        for key in [key for key in self.accepted if key[0] <= iteration]:
            del self.accepted[key]
        self.unaccepted += dropped
        return dropped
