"""Addresses of this machine for tests of listeners: a node address other than 127.0.0.1."""

from __future__ import annotations

import socket

import psutil


def node_address() -> str:
    """An IPv4 address of this machine outside 127.0.0.0/8 (what a node's listeners bind), or, on a machine
    with loopback only, 127.0.0.2 (Linux answers on all of 127.0.0.0/8): either way not 127.0.0.1, so a
    listener bound to it is not reachable at 127.0.0.1."""
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return "127.0.0.2"


def accepts(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection to host:port is accepted."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
