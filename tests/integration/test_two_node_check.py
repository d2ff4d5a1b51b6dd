"""bench/two_node_check.py across two "nodes" (network namespaces a and b joined by a veth pair): rank 0 on
a hosts the store on a's address, rank 1 on b connects, the broadcast crosses the pair over gloo and the
bytes are checked; a store address nobody listens on fails within --timeout with a named error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.integration.netns import NetnsNode, netns_unavailable, two_nodes
from tests.support.paths import ROOT

pytestmark = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))

PORT = 29517  # the namespaces are new: nothing else listens in them
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}  # gloo, as on a CPU cluster


def start(node: NetnsNode, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*node.prefix, sys.executable, "bench/two_node_check.py", *args],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """The process's output once it exits; killed by pid if it outlives `timeout`."""
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def veth_of(node: NetnsNode) -> str:
    """The interface that holds the node's address in its namespace, as `ip` reports it."""
    out = subprocess.run(
        ["ip", "-n", node.namespace, "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    return next(line.split()[1] for line in out.splitlines() if f"inet {node.address}/" in line)


def test_broadcast_crosses_the_veth_pair_and_the_bytes_match(tmp_path):
    report = tmp_path / "check.json"
    with two_nodes() as (a, b):
        store = f"{a.address}:{PORT}"
        common = ("--store", store, "--mb", "8", "--rounds", "3", "--timeout", "20")
        rank0 = start(a, "--rank", "0", *common, "--json", str(report))
        rank1 = start(b, "--rank", "1", *common)
        out1 = finish(rank1, 60)
        out0 = finish(rank0, 60)
        interfaces = veth_of(a), veth_of(b)
    print(out0, out1, sep="")
    assert rank0.returncode == 0, out0
    assert rank1.returncode == 0, out1
    figures = json.loads(report.read_text())
    assert figures["backend"] == "gloo" and figures["peer"]["backend"] == "gloo"
    assert (figures["interface"], figures["peer"]["interface"]) == interfaces
    assert "lo" not in interfaces
    assert figures["store"] == store and figures["matched"] and figures["mismatched_rounds"] == []
    assert figures["bytes"] == 8 * 2**20 and len(figures["seconds"]) == 3
    assert 0 < figures["gb_per_s_min"] <= figures["gb_per_s"] <= figures["gb_per_s_max"]
    assert f"gloo over {interfaces[0]}" in out0 and "bytes match" in out0
    assert f"gloo over {interfaces[1]}" in out1 and "bytes match" in out1


def test_a_store_nobody_listens_on_fails_within_the_timeout_naming_it():
    with two_nodes() as (a, b):
        nobody = a.address.rsplit(".", 1)[0] + ".3"  # in the namespaces' subnet, on no interface
        started = time.monotonic()
        rank1 = start(b, "--rank", "1", "--store", f"{nobody}:{PORT}", "--mb", "8", "--timeout", "5")
        out = finish(rank1, 60)
        elapsed = time.monotonic() - started
    print(out, f"failed after {elapsed:.1f} s")
    assert rank1.returncode == 1, out
    assert f"two_node_check rank 1 (store {nobody}:{PORT}): FAILED:" in out
    assert "could not join within 5s" in out
    assert elapsed < 5 + 30, out  # the timeout, the grace and a slow interpreter start on a loaded machine
