"""A process's own socket that env workers send to directly (`cluster.leases`): an inference replica's
(their Generates, `inference/direct.py`) and a trainer's (their episodes' Groups, `training/direct_groups.py`).

Socket: ROUTER bound on the process's node address (`Deployment.address`) at a port the OS picks; the
endpoint goes into the process's Hello and the router tells the env workers. It is driven by `RouterSocket`
(plain pyzmq calls woken by the event loop, as the router's own socket). ROUTER_MANDATORY: a message for a
connection that has gone (its worker was lost) is logged and dropped, never queued for ever.

With the deployment's keys it is a CURVE server holding the process's own key pair (the one its public key
in RUN_DIR/keys/public.json is), and the ZAP handler of the process's context (`RunAuthenticator`, env
worker keys only; started before the bind, so no handshake goes unchecked) admits only the env workers,
each as its process: libzmq gives every message of the connection that name as its User-Id. A refused
handshake is counted and logged (`RefusedHandshakes`). Without keys (`cluster.curve` false) a worker's
connection is named by its socket identity, the worker's name (ROUTER_HANDOVER lets a restarted worker take
it over). What does not decode is dropped and counted (`malformed`); what the owner will not take it drops
with `refuse` (`refused`), both with rate-limited warnings.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio

from mas_async.runtime.actor import make_socket
from mas_async.runtime.curve import RunAuthenticator, secure_server
from mas_async.runtime.handshakes import RefusedHandshakes
from mas_async.runtime.log_limit import LogLimit, printable
from mas_async.runtime.router_socket import RouterSocket
from mas_async.wire.codec import CodecError
from mas_async.wire.messages import Message, decode

log = logging.getLogger("mas_async.runtime.direct_socket")

Spawn = Callable[[Coroutine[Any, Any, Any], str], asyncio.Task]

SENDERS = ("env_worker",)
"""The roles whose keys a direct socket admits."""


def bind_endpoint(address: str) -> str:
    """The endpoint to bind on `address` at a port the OS picks (an IPv6 address in brackets)."""
    return f"tcp://[{address}]:*" if ":" in address else f"tcp://{address}:*"


class DirectSocket:
    """A ROUTER socket that admits env workers only, handing each decoded message to `on_message(sender,
    route, msg)`: the sending process's name and the connection to answer it on."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        keys_dir: str | None,
        on_message: Callable[[str, bytes, Message], None],
        secret: str | None = None,
        what: str = "messages",
    ) -> None:
        self.ctx = ctx
        self.address = address
        """The node address the socket binds to."""
        self.keys_dir = keys_dir
        self.secret = secret
        """The process's CURVE secret key (None: the one the launcher gave this process)."""
        self.on_message = on_message
        self.what = what
        """What the socket takes, for its log lines ("requests", "groups")."""
        self.endpoint = ""
        """Where the socket listens, "tcp://<address>:<port>" (once `start` ran)."""
        self.refused = 0
        """Well-formed messages dropped so far (`refuse`)."""
        self.malformed = 0
        """Messages dropped so far because they did not decode (or came without a User-Id)."""
        self.refusals = RefusedHandshakes()
        """ZeroMQ handshakes refused so far (keys that are not an env worker's of the run)."""
        self._warnings = LogLimit()
        self.io: RouterSocket | None = None

    def start(self, spawn: Spawn) -> str:
        """Bind and start receiving (supervised tasks made with `spawn`); returns the endpoint."""
        sock = make_socket(self.ctx, zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        authenticator = None
        if self.keys_dir is None:
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        else:
            secure_server(sock, self.keys_dir, self.secret)
            authenticator = RunAuthenticator(self.ctx, self.keys_dir, roles=SENDERS)
            authenticator.start()
            spawn(authenticator.serve(), "direct-zap")
        spawn(self.refusals.watch(sock, authenticator), "direct-refused-handshakes")
        if ":" in self.address:
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(bind_endpoint(self.address))
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock  # owns the socket (closed with the context)
        self.io = RouterSocket(zmq.Socket.shadow(sock.underlying), self._on_frames, spawn=spawn)
        spawn(self.io.run(), "direct-receive")
        log.info("taking %s directly at %s", self.what, self.endpoint)
        return self.endpoint

    def send(self, route: bytes, frames: list) -> None:
        """Send an encoded message on connection `route`."""
        assert self.io is not None
        self.io.send([route, *frames])

    def _on_frames(self, frames: list) -> None:
        route, body = frames[0].bytes, frames[1:]
        sender = self._sender(route, body)
        if sender is None:
            return
        try:
            msg = decode([f.buffer for f in body])
        except CodecError as e:
            self.malformed += 1
            if n := self._warnings.due("malformed"):
                log.warning("dropped a malformed message from %s (%d so far): %s", printable(sender), n, e)
            return
        self.on_message(sender, route, msg)

    def _sender(self, route: bytes, body: list) -> str | None:
        """The process that sent over connection `route`: its key's (the User-Id ZAP gave the connection), or
        without CURVE its socket identity; None, counted as malformed, when a CURVE message has no User-Id."""
        if self.keys_dir is None:
            return route.decode("utf-8", "replace")
        try:
            return body[0].get("User-Id")
        except (zmq.ZMQError, IndexError, AttributeError):
            self.malformed += 1
            if n := self._warnings.due("no user id"):
                log.warning("dropped a message from %s without a User-Id (%d so far)", printable(route), n)
            return None

    def refuse(self, sender: str, why: str) -> None:
        """Drop a well-formed message; counted, and logged rate-limited (`why` keys the rate limit)."""
        self.refused += 1
        if n := self._warnings.due(why):
            log.warning("dropped a message from %s on the direct socket: %s (%d such so far, %d refused in all)",
                        printable(sender), why, n, self.refused)  # fmt: skip
