"""The stores of the weight groups listen on their node's address only, not on every interface."""

from __future__ import annotations

import psutil

from mas_async.deployment import free_ports
from mas_async.weights.store import open_store


def _listening(port: int) -> list[str]:
    return [c.laddr.ip for c in psutil.net_connections(kind="tcp") if c.status == "LISTEN" and c.laddr.port == port]


def test_the_master_store_listens_on_its_address_only():
    address = "127.0.0.2"  # loopback holds all of 127/8: an address other than the default one
    port = free_ports(address, 1)[0]
    store = open_store(address, port, 2, is_master=True, timeout_s=10)
    try:
        assert _listening(port) == [address]  # torch alone listens on 0.0.0.0 / :: whatever the host is
        client = open_store(address, port, 2, is_master=False, timeout_s=10)
        client.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        del store
