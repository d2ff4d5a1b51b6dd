"""Two-node check: does the weight path between two nodes work, and how fast is it? Run it before a long
multi-node run, one process per node (docs/gpu.md, "Two nodes before a long run").

    # inside a SLURM allocation: rank from SLURM_PROCID, the store on the allocation's first node
    srun -N2 --ntasks-per-node=1 python bench/two_node_check.py
    # by hand: HOST is node 0's address (its store binds it), the same PORT on both
    python bench/two_node_check.py --rank 0 --store HOST:PORT      # on node 0
    python bench/two_node_check.py --rank 1 --store HOST:PORT      # on node 1

Each node needs mas-async installed in the Python it runs (`pip install -e .`) or PYTHONPATH set to the
checkout.

The two processes form a weight group as a run does (`mas_async.weights.group`: rank 0 hosts the TCPStore
on its own address; gloo is pinned to the interface that routes to the peer), NCCL when CUDA is available
(each rank on its local GPU), else gloo; `--backend` overrides. Rank 0 broadcasts `--mb` megabytes
(400 MB: ~100M parameters in fp32) `--rounds` times after one warm-up; each round is timed from both
ranks leaving a barrier until both have passed a second one, so the receiver has every byte. Rank 1
compares the SHA-256 of what it received in each round with rank 0's (exchanged through the store).

Prints one summary line per rank (backend, interface, GB/s median and range, whether the bytes matched);
rank 0 writes the figures of both ranks to `--json FILE`. Every wait is bounded by `--timeout` and a
failure is one line naming the store address and the rank. Exit status 0 only when the bytes matched.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from mas_async.network import interface_of, local_address_towards
from mas_async.weights.group import WeightGroup, open_weight_group

GROUP = "two-node-check"
"""The weight group's name: its store keys live under `weights/two-node-check/`, the check's own under
`two-node-check/`."""
GRACE_S = 5.0
"""Extra time the check gives a step bounded by torch itself, so torch's own (more precise) error wins."""
T = TypeVar("T")


class CheckError(RuntimeError):
    """A step of the check failed or did not finish in time; the message says which."""


@dataclass(frozen=True)
class Place:
    """Where this process stands: its rank and node 0's store."""

    rank: int
    host: str
    """Node 0's address (an IP): rank 0's store listens on it, rank 1 connects to it."""
    port: int
    source: str
    """"arguments" or "SLURM"."""

    @property
    def store(self) -> str:
        return f"{self.host}:{self.port}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, choices=(0, 1), help="this node's rank (default: SLURM_PROCID)")
    p.add_argument("--store", metavar="HOST:PORT", help="node 0's address and a free port (default: SLURM)")
    p.add_argument("--port", type=int, help="the store's port under SLURM (default: 20000 + job id % 20000)")
    p.add_argument("--backend", choices=("nccl", "gloo"), help="default: nccl with CUDA, else gloo")
    p.add_argument("--mb", type=int, default=400, help="megabytes per broadcast (400: ~100M fp32 parameters)")
    p.add_argument("--rounds", type=int, default=5, help="timed broadcasts (median and range reported)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any one wait may take")
    p.add_argument("--json", metavar="FILE", help="rank 0 writes the figures of both ranks here")
    return p.parse_args(argv)


def place_of(args: argparse.Namespace) -> Place:
    """From `--rank`/`--store`, else from the SLURM allocation; ValueError with a sentence otherwise."""
    if args.rank is not None or args.store is not None:
        if args.rank is None or args.store is None:
            raise ValueError("--rank and --store go together (or give neither inside a SLURM allocation)")
        host, _, port = args.store.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--store {args.store!r} is not HOST:PORT")
        return Place(args.rank, resolve(host), int(port), "arguments")
    if "SLURM_PROCID" not in os.environ:
        raise ValueError("outside SLURM give --rank 0|1 and --store HOST:PORT (HOST: node 0's address)")
    if os.environ.get("SLURM_NTASKS") != "2":
        raise ValueError(
            f"the check runs 2 tasks, one per node (srun -N2 --ntasks-per-node=1), "
            f"not SLURM_NTASKS={os.environ.get('SLURM_NTASKS')}"
        )
    from mas_async.launch.engines.slurm import allocation_nodes  # scontrol show hostnames, bounded

    first = allocation_nodes(os.environ["SLURM_JOB_NODELIST"], args.timeout)[0]
    port = args.port or 20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000
    return Place(int(os.environ["SLURM_PROCID"]), first.address, port, "SLURM")


def resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise ValueError(f"store host {host!r} does not resolve: {e}") from None


def bounded(what: str, seconds: float, fn: Callable[[], T]) -> T:
    """`fn()` in a helper thread, waited for at most `seconds`. A stuck collective cannot be interrupted,
    so after a CheckError the process must exit without joining it (`main` does)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as e:  # re-raised below, in the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=run, name=what, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise CheckError(f"{what} did not finish within {seconds:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def pick_backend(args: argparse.Namespace) -> str:
    if args.backend:
        return args.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def interface(backend: str, host: str) -> tuple[str | None, str]:
    """(interface name or None, where it comes from) for this rank's side of the path."""
    if backend == "gloo":
        address = local_address_towards(host)
        return interface_of(address), f"gloo pinned to {address}"
    pinned = os.environ.get("NCCL_SOCKET_IFNAME")
    if pinned:
        return pinned, "NCCL_SOCKET_IFNAME"
    return None, "chosen by NCCL: set NCCL_SOCKET_IFNAME to pin it, NCCL_DEBUG=INFO to see NCCL's choice"


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.cpu().numpy().view("uint8")).hexdigest()


def measure(group: WeightGroup, place: Place, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up and `args.rounds` timed broadcasts; this rank's seconds and, on rank 1, its digests."""
    store = dist.PrefixStore(f"{GROUP}/", group.store)
    count = args.mb * 2**20 // 4
    if place.rank == 0:
        payload = torch.rand(count, generator=torch.Generator().manual_seed(0)).to(group.device)
        store.set("sent", digest(payload))
    else:
        payload = torch.empty(count, device=group.device)
    flag = torch.zeros(1, device=group.device)

    def barrier() -> None:
        group.pg.allreduce([flag]).wait()
        if group.device.type == "cuda":
            torch.cuda.synchronize(group.device)

    def one_round() -> float:
        barrier()
        start = time.perf_counter()
        group.broadcast(payload)
        barrier()  # rank 1 has every byte once both have passed it
        return time.perf_counter() - start

    bounded("the warm-up broadcast", args.timeout + GRACE_S, one_round)
    seconds, digests = [], []
    for i in range(args.rounds):
        if place.rank == 1:
            payload.zero_()  # every round must deliver the bytes anew
        seconds.append(bounded(f"broadcast round {i + 1}", args.timeout + GRACE_S, one_round))
        if place.rank == 1:
            digests.append(digest(payload))
    figures: dict[str, Any] = {"rank": place.rank, "seconds": seconds}
    if place.rank == 1:
        sent = bounded("reading rank 0's digest", args.timeout + GRACE_S, lambda: store.get("sent").decode())
        figures["mismatched_rounds"] = [i + 1 for i, d in enumerate(digests) if d != sent]
    return figures


def gb_per_s(nbytes: int, seconds: list[float]) -> dict[str, float]:
    rates = [nbytes / s / 1e9 for s in seconds]
    return {"gb_per_s": statistics.median(rates), "gb_per_s_min": min(rates), "gb_per_s_max": max(rates)}


def run(place: Place, args: argparse.Namespace) -> dict[str, Any]:
    """Join, measure, exchange: this rank's report (rank 0's also holds rank 1's)."""
    backend = pick_backend(args)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("SLURM_LOCALID", os.environ.get("LOCAL_RANK", "0"))))
    name, pinned_by = interface(backend, place.host)
    group = bounded(
        "joining the group",
        args.timeout + GRACE_S,
        lambda: open_weight_group(
            policy=GROUP, backend=backend, host=place.host, port=place.port, rank=place.rank, world_size=2,
            timeout_s=args.timeout,
        ),
    )  # fmt: skip
    figures = measure(group, place, args)
    nbytes = args.mb * 2**20
    report = {
        "node": socket.gethostname(), "backend": backend, "interface": name, "interface_from": pinned_by,
        "device": str(group.device), "store": place.store, "from": place.source, "mb": args.mb,
        "bytes": nbytes, "rounds": args.rounds, **figures, **gb_per_s(nbytes, figures["seconds"]),
    }  # fmt: skip
    store = dist.PrefixStore(f"{GROUP}/", group.store)
    if place.rank == 1:
        store.set("rank1", json.dumps(report))
    else:
        peer = json.loads(bounded("reading rank 1's report", args.timeout + GRACE_S, lambda: store.get("rank1")))
        report["mismatched_rounds"] = peer["mismatched_rounds"]
        report["peer"] = peer
    report["matched"] = not report["mismatched_rounds"]
    group.close()  # only after success: on a failure a collective may still hold the group (main exits)
    return report


def summary(report: dict[str, Any]) -> str:
    where = report["interface"] or "interface chosen by NCCL"
    verdict = "bytes match" if report["matched"] else f"BYTES DIFFER in rounds {report['mismatched_rounds']}"
    line = (
        f"two_node_check rank {report['rank']} on {report['node']}: {report['backend']} over {where} "
        f"({report['interface_from']}), store {report['store']}: {report['mb']} MB x {report['rounds']}: "
        f"{report['gb_per_s']:.2f} GB/s median ({report['gb_per_s_min']:.2f}-{report['gb_per_s_max']:.2f}), {verdict}"
    )
    if report["interface"] == "lo":
        line += " [loopback: both ranks are on one node]"
    return line


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        place = place_of(args)
    except (ValueError, RuntimeError) as e:
        print(f"two_node_check: {e}", file=sys.stderr)
        return 2
    try:
        report = run(place, args)
    except RuntimeError as e:  # CheckError, WeightGroupError, torch's DistError
        print(f"two_node_check rank {place.rank} (store {place.store}): FAILED: {e}", file=sys.stderr, flush=True)
        os._exit(1)  # a collective may still be stuck in a helper thread: do not wait for it
    print(summary(report), flush=True)
    if place.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["matched"] else 1


if __name__ == "__main__":
    sys.exit(main())
