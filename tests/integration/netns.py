"""Two "nodes" on one machine: network namespaces joined by a veth pair, each with its own address.

Needs root and `ip` (iproute2); `two_nodes()` says why not otherwise. Everything created here is named
after this process's pid and removed at the end (deleting a namespace removes its end of the pair).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class NetnsNode:
    name: str
    namespace: str
    address: str

    @property
    def prefix(self) -> list[str]:
        """Runs a command inside the namespace with this machine's files (`ip netns exec` would remount
        /sys, which some daemons mind)."""
        return ["nsenter", f"--net=/run/netns/{self.namespace}"]

    def as_config(self) -> str:
        """This node as a `cluster.nodes` entry (YAML flow style, for a command-line override)."""
        return f"{{name: {self.name}, address: {self.address}, prefix: [{', '.join(self.prefix)}]}}"


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "nsenter") if shutil.which(tool) is None]
    return f"missing {', '.join(missing)}" if missing else None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextmanager
def two_nodes() -> Iterator[tuple[NetnsNode, NetnsNode]]:
    """Namespaces a and b, addresses 10.X.Y.1 and 10.X.Y.2 on one veth pair, loopback up in each."""
    tag = f"{os.getpid()}-{random.randrange(1 << 16):x}"
    subnet = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
    nodes = (NetnsNode("a", f"mas-a-{tag}", f"{subnet}.1"), NetnsNode("b", f"mas-b-{tag}", f"{subnet}.2"))
    veths = (f"mva{os.getpid() % 100000}", f"mvb{os.getpid() % 100000}")
    made: list[str] = []
    try:
        for node in nodes:
            _ip("netns", "add", node.namespace)
            made.append(node.namespace)
        _ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for node, veth in zip(nodes, veths, strict=True):
            _ip("link", "set", veth, "netns", node.namespace)
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", veth)
            _ip("-n", node.namespace, "link", "set", veth, "up")
            _ip("-n", node.namespace, "link", "set", "lo", "up")
        yield nodes
    finally:
        for namespace in made:
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, timeout=10)
