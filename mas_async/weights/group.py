"""A policy's weight-broadcast group: rank 0 is the trainer's rank 0, ranks 1..R its inference servers.

The group is built without `init_process_group`: rank 0 hosts a TCPStore on (host, port), every rank
wraps it in `PrefixStore("weights/<policy>")` and constructs a ProcessGroupGloo (CPU) or
ProcessGroupNCCL (GPU) object directly. Inside a vLLM worker vLLM owns the default process group, so
this is the only way the same code can run there too. A group that lost a replica is re-formed under a
new generation (`weights/<policy>/gen<G>` on the same store, joined by the trainer and every replica);
the trainer retires the old one (`WeightGroup.retire`: a key in its prefix), and a rank still waiting in
it, to join or in a broadcast, sees the key within `POLL_S` and raises `GroupRetired` (docs/faults.md).
`WeightGroupSpec.of(config, deployment, policy)` computes every rank's arguments once, from the
deployment; its backend may also be cuda_ipc, which is no torch.distributed group
(`mas_async.weights.sync` opens the right sender and receiver for each). The wire protocol of one send is
described in `mas_async.weights.sender`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mas_async.network import local_address_towards
from mas_async.placement import PlacementError, check_group_gpus
from mas_async.weights.store import open_store

if TYPE_CHECKING:
    from mas_async.config import Config
    from mas_async.deployment import Deployment

WEIGHT_BACKENDS = ("gloo", "nccl")
POLL_S = 0.2
"""How often a rank waiting in a join or a broadcast checks whether its group was retired."""
SPIN_MAX_S = 0.01
"""Longest pause between two looks at whether a broadcast completed (the pauses grow from 0.1 ms)."""
RETIRED_KEY = "retired"


class WeightGroupError(RuntimeError):
    """A rank could not join its policy's weight group in time (says which policy, rank and store)."""


class WeightSyncError(RuntimeError):
    """A broadcast of a weight update failed or passed its bound (`trainer.weight_sync_timeout_s`): says the
    policy, the rank, what was being sent and whom it waited for."""


class GroupRetired(WeightSyncError):
    """The group was retired while this rank waited in it: it is being re-formed under a newer generation
    (a replica was lost), and the wait is abandoned."""


class ManifestMismatch(ValueError):
    """The received weights do not have the names, shapes or dtypes the receiver expects."""


@dataclass
class WeightGroup:
    """One rank's handle on a policy's weight-broadcast group. Rank 0 (the trainer) also holds the
    TCPStore server, which must stay alive as long as the group is used."""

    policy: str
    backend: str
    rank: int
    world_size: int
    device: torch.device
    pg: dist.ProcessGroup | None
    """None once the generation is retired (the communicator is let go of, see `retire`)."""
    store: dist.Store
    """The TCPStore (rank 0 hosts its server; a re-formed generation meets on the same one)."""
    timeout_s: float = 300.0
    generation: int = 0
    prefix_store: dist.Store | None = None
    _retired: threading.Event = field(default_factory=threading.Event)

    def retire(self) -> None:
        """Give this generation up (rank 0: a newer one is being formed, or a send failed; the others: rank 0
        did, or a newer one is joined here): every rank still waiting in it raises `GroupRetired` within
        `POLL_S`, and its communicator is let go of (`_let_go`)."""
        if self.rank == 0 and self.prefix_store is not None and not self._retired.is_set():
            self.prefix_store.set(RETIRED_KEY, "1")
        self._retired.set()
        self._let_go()

    def retired(self) -> bool:
        """Was this generation given up (here, or by rank 0 through the store)?"""
        if not self._retired.is_set() and self.rank > 0 and self.prefix_store is not None:
            if self.prefix_store.check([RETIRED_KEY]):
                self.retire()
        return self._retired.is_set()

    def _let_go(self) -> None:
        """Close the communicator of a retired generation, off the caller's thread. Its sockets closing ends
        at once a peer's receive from this rank; its destructor waits for this rank's own abandoned work,
        up to the group's timeout, so it must not run where the next generation is being joined."""
        pg, self.pg = self.pg, None
        if pg is None:
            return
        if self.backend == "nccl":  # a kernel waiting for a lost peer never returns: abort the communicator
            pg.abort()
        held = [pg]
        del pg  # `held` is the last reference: the thread that empties it runs the destructor
        name = f"weights-{self.policy}-gen{self.generation}-close"
        threading.Thread(target=held.clear, name=name, daemon=True).start()

    def broadcast(self, tensor: torch.Tensor, what: str = "a broadcast") -> None:
        """Broadcast `tensor` in place from rank 0 and wait for it (at most `timeout_s`; `what` names it
        in the error; `GroupRetired` if the group is retired meanwhile)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        pg = self.pg
        if pg is None or self._retired.is_set():
            raise self._abandoned(what)
        try:
            work = pg.broadcast([tensor], opts)
            del pg  # only `_let_go`'s thread may hold the communicator last (its destructor may block)
            self._wait(work, what)
        except GroupRetired:
            raise
        except (RuntimeError, dist.DistError) as e:
            waited_for = (
                f"its inference replicas (ranks 1..{self.world_size - 1})" if self.rank == 0 else "its trainer (rank 0)"
            )
            raise WeightSyncError(
                f"rank {self.rank} of policy {self.policy!r}'s weight group ({self.backend}): {what} did not complete "
                f"within {self.timeout_s:g} s, waiting for {waited_for}: {e}"
            ) from e

    def _wait(self, work: dist.Work, what: str) -> None:
        """Wait for `work` to complete, at most `timeout_s`, checking every POLL_S whether the group was
        retired. Only `is_completed()` is polled: a timed `work.wait(timeout)` on an NCCL group aborts the
        communicator once the timeout has passed since the work *started* and rethrows (PyTorch's
        `WorkNCCL::wait`: `checkTimeout` sets the exception, then `abort()`), so a broadcast longer than
        one poll would kill the group. Once complete, the untimed wait returns (NCCL: it also orders the
        current stream after the broadcast) or raises the operation's own error."""
        start = time.monotonic()
        deadline, next_look, pause = start + self.timeout_s, start + POLL_S, 1e-4
        while not work.is_completed():
            now = time.monotonic()
            if now >= next_look:  # a store round trip for ranks > 0: not at every spin
                if self.retired():
                    raise self._abandoned(what)
                next_look = now + POLL_S
            if now >= deadline:
                raise RuntimeError(f"the {self.backend} work was not complete after {self.timeout_s:g} s")
            time.sleep(pause)
            pause = min(2 * pause, SPIN_MAX_S)
        work.wait()  # complete: a success even if the group was retired just now (the peers count it done)

    def _abandoned(self, what: str) -> GroupRetired:
        return GroupRetired(
            f"rank {self.rank} of policy {self.policy!r}'s weight group (generation {self.generation}): "
            f"{what} was abandoned, the group is being re-formed"
        )

    def close(self) -> None:
        """Release the communicator (the store server stops when the object is collected)."""
        if self.pg is None:
            return
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()


def open_weight_group(
    *,
    policy: str,
    backend: str,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float = 300,
    generation: int = 0,
    store: dist.Store | None = None,
) -> WeightGroup:
    """Join generation `generation` of the weight group of `policy`; blocks until all `world_size` ranks
    have joined (`GroupRetired` if rank 0 retires that generation meanwhile).

    Rank 0 listens on (host, port), or re-forms the group on the TCPStore it already hosts (`store`); the
    others connect to it, retrying until `timeout_s`.
    """
    if backend not in WEIGHT_BACKENDS:
        raise ValueError(f"unknown weight-sync backend {backend!r}; known: {list(WEIGHT_BACKENDS)}")
    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(f"need world_size >= 2 and 0 <= rank < world_size, got rank {rank} of {world_size}")
    try:
        return _join(
            policy=policy, backend=backend, host=host, port=port, rank=rank, world_size=world_size,
            timeout_s=timeout_s, generation=generation, tcp_store=store,
        )  # fmt: skip
    except (RuntimeError, dist.DistError) as e:
        if isinstance(e, (WeightGroupError, GroupRetired, PlacementError)):
            raise
        raise WeightGroupError(
            f"rank {rank} of policy {policy!r}'s weight group ({backend}, {world_size} ranks, store at {host}:{port}) "
            f"could not join within {timeout_s:g}s: {e}"
        ) from e


def group_prefix(policy: str, generation: int) -> str:
    """The store prefix of a generation of `policy`'s weight group (the first one keeps the plain name)."""
    return f"weights/{policy}" + (f"/gen{generation}" if generation else "")


def _join(
    *,
    policy: str,
    backend: str,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    generation: int,
    tcp_store: dist.Store | None,
) -> WeightGroup:
    timeout = timedelta(seconds=timeout_s)
    deadline = time.monotonic() + timeout_s  # reaching the store and meeting the others share the bound
    if tcp_store is None:
        tcp_store = open_store(host, port, world_size, is_master=rank == 0, timeout_s=timeout_s)
    store = dist.PrefixStore(group_prefix(policy, generation), tcp_store)
    # Meet first: a rank lost before the group formed must not leave the others in its rendezvous.
    _arrive(store, policy, rank, world_size, timeout_s, generation, deadline)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # Pin gloo to the address that reaches the store, not whatever the host name resolves to.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(host))]
        pg = dist.ProcessGroupGloo(store, rank, world_size, options)
        device = torch.device("cpu")
    else:
        # Two ranks on one GPU would fail inside NCCL's init, without saying which: named here first.
        check_group_gpus(store, policy, "nccl", rank, world_size, max(0.0, deadline - time.monotonic()))
        if not dist.is_nccl_available():
            raise ValueError("weight-sync backend 'nccl' needs a torch build with NCCL (use 'gloo' on CPU)")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        device = torch.device("cuda", torch.cuda.current_device())
    # Keep the TCPStore (rank 0 hosts its server) alive alongside the group.
    return WeightGroup(policy, backend, rank, world_size, device, pg, tcp_store, timeout_s, generation, store)


def retire_generation(store: dist.Store, policy: str, generation: int) -> None:
    """Rank 0: give up generation `generation` of `policy`'s group on the TCPStore it hosts, whether it has
    formed yet or not (ranks waiting to join it stop waiting)."""
    dist.PrefixStore(group_prefix(policy, generation), store).set(RETIRED_KEY, "1")


def _arrive(
    store: dist.Store, policy: str, rank: int, world_size: int, timeout_s: float, generation: int, deadline: float
) -> None:
    """A barrier on the store, until `deadline` (monotonic; the join's `timeout_s`), that gives up when the
    generation is retired (the process group's own rendezvous would wait its whole timeout for a rank that
    died)."""
    store.add("arrived", 1)
    while store.add("arrived", 0) < world_size:
        if store.check([RETIRED_KEY]):
            raise GroupRetired(
                f"rank {rank} of policy {policy!r}'s weight group: generation {generation} was retired before "
                f"every rank joined it"
            )
        if time.monotonic() > deadline:
            raise WeightGroupError(
                f"rank {rank} of policy {policy!r}'s weight group: generation {generation} was not joined by all "
                f"{world_size} ranks within {timeout_s:g}s"
            )
        time.sleep(0.02)


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The weight dtypes a policy may be configured with (`policies.<p>.dtype`)."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a configured dtype name; a ValueError names the known ones."""
    if name not in TORCH_DTYPES:
        raise ValueError(f"unknown weights dtype {name!r}; known: {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest spelling of a dtype: "float32", "bfloat16", ..."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ManifestMismatch(f"unknown dtype {name!r} in the weight manifest")
    return dtype


@dataclass(frozen=True)
class WeightGroupSpec:
    """Where and how big a policy's weight group is: the same for the trainer and every replica."""

    policy: str
    backend: str
    """gloo (CPU), nccl (GPUs) or cuda_ipc (trainer and servers on one GPU), as the deployment decided it
    (`Deployment.weight_backend`, `mas_async.placement`)."""
    host: str
    port: int
    world_size: int
    """1 trainer rank + the inference replicas that serve the policy (its base's, on a shared base): the first
    generation's; a re-formed one has its members' (`ReformWeightGroup`)."""
    timeout_s: float = 300.0
    """Bound of joining and of every wait of a send or receive (`trainer.weight_sync_timeout_s`)."""

    @classmethod
    def of(cls, config: Config, deployment: Deployment, policy: str) -> WeightGroupSpec:
        return cls(
            policy=policy,
            backend=deployment.weight_backend(config, policy),
            host=deployment.store_host(policy),
            port=deployment.weight_ports[policy],
            world_size=1 + config.policies[config.server_policy(policy)].replicas,
            timeout_s=config.trainer.weight_sync_timeout_s,
        )

    def join_args(self, rank: int, generation: int = 0, world_size: int | None = None) -> dict[str, Any]:
        """Keyword arguments of `open_weight_group` (and of a backend's `join_weight_group`) for `rank`, in
        generation `generation` of the group, of `world_size` ranks (a re-formed generation's; default: the
        first generation's, every replica of the deployment)."""
        return {
            "policy": self.policy, "backend": self.backend, "host": self.host, "port": self.port, "rank": rank,
            "world_size": world_size or self.world_size, "timeout_s": self.timeout_s, "generation": generation,
        }  # fmt: skip

    def open(self, rank: int) -> WeightGroup:
        """Join the torch.distributed group as `rank` (blocking until every rank has joined); gloo and
        nccl only: `mas_async.weights.sync` opens a sender or receiver of any backend."""
        return open_weight_group(**self.join_args(rank))
