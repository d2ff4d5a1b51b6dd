"""An env worker's connection to another process's direct socket (`cluster.leases`): a leased inference
replica's (its Generates, and their results back) or a trainer's (its episodes' Groups).

Socket: DEALER connected to the process's ROUTER (`mas_async.runtime.direct_socket`). With the deployment's
keys it is a CURVE client holding this worker's own key pair that requires the public key of the process
`name` (from RUN_DIR/keys/public.json) at the other end: it talks to that process and no other, and that
process knows it as this worker. Its socket identity is then <worker>#<random>, new for every connection;
without keys it is the worker's name, which a replica checks each request's origin against. Messages are
never dropped by ZeroMQ: at the high-water mark the DEALER holds them (the barrier bounds what is in
flight), and to a process that is not reachable (yet, or any more) they wait in its queue; a replica's
link is closed when the lease says it left (its requests are sent again elsewhere), dropping what was
queued (linger 0).

Socket IO lives in two supervised tasks of the worker (`spawn`): one drains the outbox, so `send` never
blocks its caller; one receives, handing each message's frames to `on_frames` with the process's name.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio

from mas_async.runtime.actor import make_socket
from mas_async.runtime.curve import secure_client

Spawn = Callable[[Coroutine[Any, Any, Any], str], asyncio.Task]


class DirectLink:
    """A DEALER to process `name`'s direct socket at `endpoint`, its outbox and its receive task."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        name: str,
        endpoint: str,
        *,
        worker: str,
        keys_dir: str | None,
        on_frames: Callable[[str, list], None],
        spawn: Spawn,
        secret: str | None = None,
    ) -> None:
        self.name = name
        self.endpoint = endpoint
        identity = worker if keys_dir is None else f"{worker}#{secrets.token_hex(8)}"
        self.sock = make_socket(ctx, zmq.DEALER, identity)
        if keys_dir is not None:
            secure_client(self.sock, keys_dir, secret, server=name)
        if endpoint.startswith("tcp://["):
            self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.connect(endpoint)
        self.on_frames = on_frames
        self._outbox: asyncio.Queue[list] = asyncio.Queue()
        self._tasks = [spawn(self._send_loop(), f"send-{name}"), spawn(self._receive_loop(), f"receive-{name}")]

    def send(self, frames: list) -> None:
        """Queue an encoded message for the process (never blocks the caller)."""
        self._outbox.put_nowait(frames)

    def close(self) -> None:
        """Stop both tasks and close the socket; what is still queued is dropped."""
        for task in self._tasks:
            task.cancel()
        self.sock.close(linger=0)

    async def _send_loop(self) -> None:
        while True:
            frames = await self._outbox.get()
            await self.sock.send_multipart(frames, copy=False)

    async def _receive_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            self.on_frames(self.name, frames)
