"""Addresses of this node: which local address reaches a peer, and which interface holds an address.

torch.distributed's gloo picks its interface from the host name unless told otherwise (which resolves
to 127.0.0.1 on many machines, and then ranks on other nodes cannot reach it): every gloo group of a run
is pinned to the address of this node that routes to the group's store (`local_address_towards`), and
the default group of the trainer ranks gets `GLOO_SOCKET_IFNAME` (`interface_of`).
"""

from __future__ import annotations

import socket

import psutil

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def local_address_towards(host: str) -> str:
    """The address of this node that packets to `host` leave from (no packet is sent)."""
    if host in LOOPBACK_HOSTS:
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP connect only picks the route
        return s.getsockname()[0]


def interface_of(address: str) -> str:
    """The name of the network interface that holds `address`; ValueError naming the ones there are."""
    found = {
        name: [a.address for a in addrs if a.family == socket.AF_INET] for name, addrs in psutil.net_if_addrs().items()
    }
    for name, addresses in found.items():
        if address in addresses:
            return name
    raise ValueError(f"no network interface of this node has the address {address} (interfaces: {found})")
