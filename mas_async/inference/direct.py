"""An inference replica's own socket (`cluster.leases`): env workers send their Generates to it directly,
and each result goes back on the connection its request came over (router/leases.py says who may send).

The socket is a `DirectSocket` (runtime/direct_socket.py: bound on the replica's node address, CURVE with
the replica's own key, only env workers admitted, each as its process). A Generate is taken only if its
`origin` is the connection's process; anything else is dropped and counted (`refused`, `malformed`). At a
worker's high-water mark results wait in an outbox, in order. Nothing is sent on this socket before a
worker's request came over it, so there is no slow joiner to wait for.

A request taken is handed to the server (`on_request`) exactly as one the router forwarded: same queue,
same limits, same update gate, same version tags. `reply` sends its result back on its connection.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq.asyncio

from mas_async.runtime.direct_socket import DirectSocket, Spawn
from mas_async.runtime.handshakes import RefusedHandshakes
from mas_async.wire.messages import Generate, GenerateResult, Message, encode


class DirectRequests:
    """The replica's direct socket: takes env workers' Generates and answers them on their connections."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        keys_dir: str | None,
        on_request: Callable[[Generate], None],
        secret: str | None = None,
    ) -> None:
        self.socket = DirectSocket(ctx, address, keys_dir, self._on_message, secret, what="requests")
        self.on_request = on_request
        self.taken = 0
        """Requests taken so far."""
        self._routes: dict[tuple[str, int], bytes] = {}
        """(origin, request id) -> the connection (socket identity) the request came over."""

    @property
    def endpoint(self) -> str:
        """Where the socket listens, "tcp://<address>:<port>" (once `start` ran)."""
        return self.socket.endpoint

    @property
    def refused(self) -> int:
        """Well-formed messages dropped so far: not a Generate, or its origin is not its connection's process."""
        return self.socket.refused

    @property
    def malformed(self) -> int:
        """Messages dropped so far because they did not decode (or came without a User-Id)."""
        return self.socket.malformed

    @property
    def refusals(self) -> RefusedHandshakes:
        """ZeroMQ handshakes refused so far (keys that are not an env worker's of the run)."""
        return self.socket.refusals

    def start(self, spawn: Spawn) -> str:
        """Bind and start receiving (supervised tasks made with `spawn`); returns the endpoint."""
        return self.socket.start(spawn)

    def reply(self, request: Generate, result: GenerateResult) -> bool:
        """Send `result` back on the connection `request` came over; False if it did not come directly."""
        route = self._routes.pop((request.origin, request.request_id), None)
        if route is None:
            return False
        self.socket.send(route, encode(result))
        return True

    def _on_message(self, sender: str, route: bytes, msg: Message) -> None:
        if not isinstance(msg, Generate):
            self.socket.refuse(sender, f"a {type(msg).__name__} is not a request")
            return
        if msg.origin != sender:
            self.socket.refuse(sender, "its origin is not its sender")
            return
        self._routes[(msg.origin, msg.request_id)] = route
        self.taken += 1
        self.on_request(msg)
