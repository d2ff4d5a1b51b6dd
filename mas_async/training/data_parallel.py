"""The data-parallel group of one policy's trainer ranks (`policies.<p>.trainer_ranks` N >= 2).

The N trainer processes of a policy join one torch.distributed group (gloo on CPU, NCCL on GPU) through
a TCPStore of their own (`Deployment.trainer_ports`, hosted by rank 0); it is the process's default
group, apart from the weight-sync group (weights/group.py), which is built without it. The learner wraps
its model in `DistributedDataParallel` over it, and `ZeroRedundancyOptimizer` shards the optimiser
state over it (`trainer.zero`). Every rank runs the same sequence of collectives each step, including a
rank that received no sample (it backpropagates a zero loss), so nothing waits for a missing peer.

Every wait is bounded by `trainer.group_timeout_s`: the join and the small collectives here raise
`RankGroupError` naming the policy and the rank (each collective's completion is polled against the bound,
as the weight group's broadcasts are). The process group itself gets the library's longer timeout
(`weights.group.library_timeout_s`), so that NCCL's watchdog, which tears the process down, never comes
before the code's named error; DDP's own gradient all-reduce, inside a backward pass, is bounded by that
library timeout alone (a rank lost there ends its peers' processes, and the router restarts the run).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mas_async.devices import current, gpu_id, shared_gpus
from mas_async.network import LOOPBACK_HOSTS, interface_of, local_address_towards
from mas_async.weights.group import library_timeout_s
from mas_async.weights.store import open_store


class RankGroupError(RuntimeError):
    """A trainer rank of a policy did not join, or did not answer a collective, within the timeout."""


@dataclass
class DataParallel:
    """This process's place in its policy's trainer group."""

    policy: str
    rank: int
    world_size: int
    backend: str
    timeout_s: float
    device: torch.device = torch.device("cpu")
    """This rank's device (`Config.trainer_device`): the object collectives run on it whichever thread calls
    them (a worker thread's current device is cuda:0)."""

    @classmethod
    def join(
        cls, *, policy: str, device: str, host: str, port: int, rank: int, world_size: int, timeout_s: float
    ) -> DataParallel:
        """Join (blocking until all `world_size` ranks have) the group of `policy`'s trainer ranks; `device` is
        this rank's (`Config.trainer_device`), made current by the caller. Ranks on one GPU are refused."""
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"need world_size >= 2 and 0 <= rank < world_size, got rank {rank} of {world_size}")
        backend = "nccl" if device.startswith("cuda") else "gloo"
        timeout = timedelta(seconds=library_timeout_s(timeout_s))
        try:
            store = open_store(host, port, world_size, is_master=rank == 0, timeout_s=timeout_s, wait_for_workers=True)
            if backend == "nccl":
                _refuse_shared_gpus(dist.PrefixStore(f"gpus/{policy}", store), policy, rank, world_size, device)
            if backend == "gloo" and host not in LOOPBACK_HOSTS:
                # The default group's gloo takes its interface from the environment only.
                os.environ.setdefault("GLOO_SOCKET_IFNAME", interface_of(local_address_towards(host)))
            dist.init_process_group(
                backend, store=dist.PrefixStore(f"trainers/{policy}", store), rank=rank, world_size=world_size,
                timeout=timeout,
            )  # fmt: skip
        except (RuntimeError, dist.DistError) as e:
            raise RankGroupError(
                f"trainer rank {rank} of policy {policy!r} could not join its {world_size} ranks at {host}:{port} "
                f"within {timeout_s}s: {e}"
            ) from e
        return cls(policy, rank, world_size, backend, timeout_s, torch.device(device))

    def sum(self, values: list[float], device: torch.device) -> list[float]:
        """Element-wise sum of `values` over every rank (float64, so token counts stay exact)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        self._bounded(lambda: dist.all_reduce(tensor, async_op=True), "sum")
        return tensor.tolist()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable, small: metrics, RNG states), in rank order, on every rank."""
        out: list[Any] = [None] * self.world_size
        # all_gather_object has no async form: it is bounded by the library's timeout, and its failure named here.
        # It takes no device: on NCCL it stages the objects on the calling thread's current device.
        with current(self.device):
            self._bounded(lambda: dist.all_gather_object(out, obj), "gather")
        return out

    def _bounded(self, call, what: str) -> None:
        """Run the collective `call` (its work, when it returns one, waited for at most `timeout_s`)."""
        try:
            work = call()
            if work is not None:
                _wait(work, self.timeout_s)
        except (RuntimeError, dist.DistError) as e:
            raise RankGroupError(
                f"trainer rank {self.rank} of policy {self.policy!r}: the {what} over {self.world_size} ranks "
                f"failed or exceeded {self.timeout_s}s: {e}"
            ) from e

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _wait(work: dist.Work, timeout_s: float) -> None:
    """Poll `work` until it completes, at most `timeout_s` (a timed `work.wait` would abort an NCCL
    communicator once the bound passed since the work started: see `weights.group.WeightGroup._wait`)."""
    deadline, pause = time.monotonic() + timeout_s, 1e-4
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the collective was not complete after {timeout_s:g} s")
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
    work.wait()


def _refuse_shared_gpus(store: dist.Store, policy: str, rank: int, world_size: int, device: str) -> None:
    """Every rank says which physical GPU it is on; two on one GPU (NCCL would fail or hang) raise
    `RankGroupError` on every rank, naming both."""
    store.set(str(rank), f"{gpu_id(torch.device(device))} {device} on {socket.gethostname()}")
    placed = [store.get(str(r)).decode().split(" ", 1) for r in range(world_size)]
    for a, b in shared_gpus([gpu for gpu, _ in placed]):
        raise RankGroupError(
            f"trainer ranks {a} ({placed[a][1]}) and {b} ({placed[b][1]}) of policy {policy!r} are on one GPU; "
            "NCCL needs one GPU per rank (policies.<p>.trainer_devices, or a GPU reserved per trainer process)"
        )


def merge_metrics(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One metrics dict of a step from every rank's: counts and loss terms (already divided by the global
    normaliser) add up, maxima take the max, means are weighted by samples or tokens over the ranks that
    measured them, anything else (lr, grad_norm, versions: equal on every rank) is rank 0's.
    `optimizer_state_bytes` stays per rank. A figure is in the merged dict when some rank measured it
    (a rank without samples measures no entropy or log-prob difference), never filled in with 0."""
    merged = dict(per_rank[0])
    for key in ("samples", "tokens", "active_samples", "micro_batches", "version_mismatch", "stale_dropped",
                "stale_samples", "stale_checked_samples", "stale_unchecked_samples", "loss", "kl",
                "episodes", "repeated_episodes", "unaccepted_samples"):  # fmt: skip
        if key in merged:
            merged[key] = sum(m[key] for m in per_rank if key in m)
    for key in ("logprob_abs_diff_max", "staleness_max", "is_weight_max"):
        values = [m[key] for m in per_rank if key in m]
        if values:
            merged[key] = max(values)
    for key, weight in (("reward_mean", "samples"), ("advantage_abs_mean", "samples"), ("staleness_mean", "samples"),
                        ("logprob_abs_diff", "tokens"), ("clip_fraction", "tokens"), ("entropy", "tokens")):  # fmt: skip
        measured = [m for m in per_rank if key in m]
        total = sum(m.get(weight, 0) for m in measured)
        if measured and total:
            merged[key] = sum(m[key] * m.get(weight, 0) for m in measured) / total
    merged["ranks"] = len(per_rank)
    merged["rank_samples_max"] = max(m.get("samples", 0) for m in per_rank)
    merged["rank_samples_min"] = min(m.get("samples", 0) for m in per_rank)
    if "optimizer_state_bytes" in merged:
        merged["optimizer_state_bytes_max"] = max(m.get("optimizer_state_bytes", 0) for m in per_rank)
    return merged
