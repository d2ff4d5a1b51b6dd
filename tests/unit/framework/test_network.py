"""This node's addresses: the one that reaches a peer, and the interface holding an address."""

from __future__ import annotations

import pytest

from mas_async.network import interface_of, local_address_towards


def test_loopback_is_reached_from_loopback_and_held_by_its_interface():
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    assert local_address_towards("127.0.0.3") == "127.0.0.1"  # routed over lo, left from its address
    assert interface_of("127.0.0.1") == "lo"


def test_an_address_no_interface_holds_is_named():
    with pytest.raises(ValueError, match=r"no network interface of this node has the address 192\.0\.2\.77"):
        interface_of("192.0.2.77")
