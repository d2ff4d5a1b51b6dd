"""The TCPStore a torch.distributed group of the run meets at, listening on its node's address only.

`dist.TCPStore(host, port, is_master=True)` listens on every interface whatever `host` is; given a socket
that is already listening (`master_listen_fd`), it serves that one. So the master binds the node address
itself and hands the socket over: `ss -ltn` shows `ADDRESS:PORT`, not `*:PORT`. What torch does not
offer: a store that knows its clients. Anyone who reaches the address may talk to it, so off a trusted
network the address must be a private one (docs/cluster.md).
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch.distributed as dist


def open_store(
    host: str, port: int, world_size: int, *, is_master: bool, timeout_s: float, wait_for_workers: bool = False
) -> dist.TCPStore:
    """The master (`is_master`) listens on (host, port) only; the others connect, retrying until `timeout_s`."""
    timeout = timedelta(seconds=timeout_s)
    if not is_master:
        _wait_for_listener(host, port, time.monotonic() + timeout_s, timeout_s)
        # `timeout` also bounds each operation on the store later, so it stays whole.
        return dist.TCPStore(
            host, port, world_size, is_master=False, timeout=timeout, wait_for_workers=wait_for_workers
        )
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(1024)
        store = dist.TCPStore(
            host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=wait_for_workers,
            master_listen_fd=listener.fileno(),
        )  # fmt: skip
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now
    return store


def _wait_for_listener(host: str, port: int, deadline: float, timeout_s: float) -> None:
    """Until something accepts connections at (host, port), by `deadline`. torch's client gives up a try
    at its timeout and sleeps about as long before the next one, so a store that comes up after the
    first try would cost up to twice the bound; probing first keeps the store's connect to one quick try."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"no store listens at {host}:{port} after {timeout_s:g}s ({e})") from e
            time.sleep(0.05)
