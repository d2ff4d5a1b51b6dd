"""Refused ZeroMQ handshakes, seen from both ends: the router counts and logs them, a peer fails on them.

A refused handshake is silent in ZeroMQ: the router never sees a message from the peer, and the peer's
messages wait in its queue while it reconnects forever. Only a socket monitor reports it, as one of
these events (libzmq >= 4.3):

- HANDSHAKE_FAILED_AUTH: the router's ZAP handler refused the peer's CURVE key (status 400);
- HANDSHAKE_FAILED_PROTOCOL: the ends do not speak the same mechanism (one uses CURVE, the other not)
  or the peer's CURVE hello does not decrypt (it holds another router public key);
- HANDSHAKE_FAILED_NO_DETAIL: the connection closed during the handshake: what a peer with the wrong
  router public key sees (the router just hangs up), and often what the router sees of a plain peer
  (which may hang up first, on the mechanism mismatch). So the router counts all three.

`RefusedHandshakes` watches the router's socket for the whole run: each failed handshake is counted (the
`router/refused_handshakes` metric) and logged with the peer's address when libzmq tells it (ZAP does,
for a refused key; a protocol failure carries no address). `HandshakeWatch` watches a peer's socket
while it waits for the router's Welcome, and turns a refusal into `HandshakeFailed` instead of a hang.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from mas_async.runtime.log_limit import LogLimit

if TYPE_CHECKING:
    from mas_async.runtime.curve import RunAuthenticator

log = logging.getLogger("mas_async.handshakes")

FAILED_AUTH = int(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
FAILED_PROTOCOL = int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
FAILED_NO_DETAIL = int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
HANDSHAKE_FAILURES = FAILED_AUTH | FAILED_PROTOCOL | FAILED_NO_DETAIL

NO_DETAIL_LIMIT = 3
"""A peer gives up after this many handshakes that the router closed without a reason."""

_PROTOCOL_REASONS = {
    int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH): "the two ends do not both use CURVE (cluster.curve differs)",
    int(zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC): "its CURVE handshake did not decrypt (another router public key)",
}


class HandshakeFailed(RuntimeError):
    """The router refused this process's ZeroMQ handshake: the two ends do not hold the same run's keys."""


def describe(event: int, value: int) -> str:
    """A failed handshake's reason, in words."""
    if event == FAILED_AUTH:
        return f"its CURVE key is not one of the run's processes' (ZAP status {value})"
    if event == FAILED_PROTOCOL:
        try:
            name = zmq.Event(value).name
        except ValueError:
            name = hex(value)
        return _PROTOCOL_REASONS.get(value, f"protocol error {name}")
    return f"the connection closed during the handshake (errno {value})"


class RefusedHandshakes:
    """Counts and logs every handshake the router's socket refused; the run goes on.

    A peer that retries in a loop must not flood the log: each (reason, address) is logged at its 1st,
    2nd, 4th, 8th... refusal, with its count; `count` always holds them all."""

    def __init__(self) -> None:
        self.count = 0
        self.authenticator: RunAuthenticator | None = None
        """The ZAP handler that remembers the address of each refused key (CURVE only)."""
        self._seen = LogLimit()

    def watch(
        self, sock: zmq.asyncio.Socket, authenticator: RunAuthenticator | None = None
    ) -> Coroutine[Any, Any, None]:
        """Monitor `sock` from now on (call it before the socket binds) and return the coroutine that
        reads its refusals until cancelled (a supervised task of the router)."""
        self.authenticator = authenticator
        return self._read(sock.get_monitor_socket(HANDSHAKE_FAILURES))

    async def _read(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            self.refused(int(event["event"]), int(event["value"]), event["endpoint"].decode(errors="replace"))

    def refused(self, event: int, value: int, endpoint: str) -> None:
        self.count += 1
        reason, address = describe(event, value), "an address libzmq does not report"
        if event == FAILED_AUTH and self.authenticator is not None and self.authenticator.refused:
            address, key = self.authenticator.refused.popleft()  # ZAP answered before libzmq reported it
            reason = f"{reason}; its key {key}"
        if seen := self._seen.due((reason, address)):
            log.warning(
                "refused a ZeroMQ handshake on %s from %s: %s (%d from there so far, %d in all)",
                endpoint, address, reason, seen, self.count,
            )  # fmt: skip


class HandshakeWatch:
    """A peer's handshakes with the router while it waits for its first reply (Welcome).

    Refused by key (FAILED_AUTH) or by protocol (FAILED_PROTOCOL) is final: `HandshakeFailed` at once.
    Closed without a reason may be a passing network fault: final after `NO_DETAIL_LIMIT` of them."""

    def __init__(self, sock: zmq.asyncio.Socket, endpoint: str, keys_dir: str | None) -> None:
        self.sock = sock
        self.endpoint = endpoint
        self.keys_dir = keys_dir
        """The CURVE keys the socket uses (None: a plain socket)."""
        self.monitor = sock.get_monitor_socket(HANDSHAKE_FAILURES)
        self.failures = 0

    async def wait_readable(self, timeout_s: float) -> bool:
        """True once the socket has a message to read, False after `timeout_s`; raises `HandshakeFailed`
        when the router refused the handshake."""
        poller = zmq.asyncio.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        clock = asyncio.get_running_loop().time
        deadline = clock() + timeout_s
        while (left := deadline - clock()) > 0:
            ready = dict(await poller.poll(timeout=left * 1000))
            if self.monitor in ready:  # one event per turn; the poller reports the next one at once
                event = parse_monitor_message(await self.monitor.recv_multipart())
                self._failed(int(event["event"]), int(event["value"]))
            if self.sock in ready:
                return True
        return False

    def _failed(self, event: int, value: int) -> None:
        self.failures += 1
        if event == FAILED_NO_DETAIL and self.failures < NO_DETAIL_LIMIT:
            return
        reason = describe(event, value)
        if self.keys_dir is None:
            mine = "no CURVE keys (its deployment.json has keys_dir null: cluster.curve=false)"
            hint = "a router that requires CURVE hangs up like this on a peer without keys"
        else:
            mine = f"its own CURVE key and the router's public key in {self.keys_dir}"
            hint = f"a router hangs up like this when {self.keys_dir}/public.json does not hold its public key"
        if event == FAILED_NO_DETAIL:
            reason = f"{reason}; {hint}"
        raise HandshakeFailed(
            f"the router at {self.endpoint} refused this process's ZeroMQ handshake: {reason} ({self.failures} "
            f"failed handshake(s)); this process uses {mine}. Every process of a run must be started by the run's "
            "launcher, which gives each its own key, with that start's deployment.json and keys"
        )

    def close(self) -> None:
        """Stop monitoring (the peer is connected; later handshakes are the heartbeats' business)."""
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
