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

Timeouts (DESIGN section 16: every timeout has one owner). The code's bound (`timeout_s`,
`trainer.weight_sync_timeout_s`) owns every wait: the meeting on the store, the group's formation and each
broadcast, each polled here and ended with `WeightGroupError` or `WeightSyncError`. gloo and NCCL get a
longer timeout of their own (`library_timeout_s`): NCCL's watchdog tears the whole process down when a
collective passes it (TORCH_NCCL_ASYNC_ERROR_HANDLING's default, 3), so it must never come first; and a
broadcast that passes the code's bound aborts the communicator at once (`WeightGroup.retire`), so the
watchdog never sees it time out at all. NCCL creates its communicator lazily, at the first collective on a
device, with no bound of its own (a blocking `ncclCommInitRank` waits for every rank for ever): the group
runs that first collective when it forms (`_form`), in a thread the joining rank waits for under the
code's bound, so a rank lost between the meeting and the first update is a named error at formation.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mas_async.devices import process_device
from mas_async.network import local_address_towards
from mas_async.placement import PlacementError, check_group_gpus
from mas_async.startup import startup_bound_s
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
LIBRARY_MARGIN_S = 60.0
"""The least a library's own timeout exceeds the code's bound by (`library_timeout_s`)."""


def library_timeout_s(bound_s: float) -> float:
    """The timeout handed to gloo and NCCL (the process group's `_timeout`, NCCL's watchdog) for a group whose
    code bound is `bound_s`: twice it, and at least `LIBRARY_MARGIN_S` more, so the code's bound and its named
    error always come first."""
    return bound_s + max(bound_s, LIBRARY_MARGIN_S)


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
        work = None
        try:
            work = pg.broadcast([tensor], opts)
            del pg  # only `_let_go`'s thread may hold the communicator last (its destructor may block)
            self._wait(work, what)
        except GroupRetired:
            raise
        except (RuntimeError, dist.DistError) as e:
            # A broadcast that failed or passed the bound leaves the communicator unusable: let it go now (NCCL:
            # aborted), before the library's own timeout would tear the process down (`library_timeout_s`).
            self.retire()
            waited_for = (
                f"its inference replicas (ranks 1..{self.world_size - 1})" if self.rank == 0 else "its trainer (rank 0)"
            )
            raise WeightSyncError(
                f"rank {self.rank} of policy {self.policy!r}'s weight group ({self.backend}): {what} did not complete "
                f"within {self.timeout_s:g} s, waiting for {waited_for}: {e}"
            ) from e
        finally:
            # An error keeps this frame's locals alive in its traceback, for as long as anyone holds the error (a
            # log record, a caller's report): the communicator, and a work, which holds its generation's gloo
            # context (its sockets and thread) even once the communicator is let go of.
            pg = work = None  # noqa: F841 (cleared, not used)

    def _wait(self, work: dist.Work, what: str) -> None:
        """Wait for `work` to complete, at most `timeout_s`, checking every POLL_S whether the group was
        retired. Only `is_completed()` is polled: a timed `work.wait(timeout)` on an NCCL group aborts the
        communicator once the timeout has passed since the work *started* and rethrows (PyTorch's
        `WorkNCCL::wait`: `checkTimeout` sets the exception, then `abort()`), so a broadcast longer than
        one poll would kill the group. Once complete, the untimed wait returns (NCCL: it also orders the
        current stream after the broadcast) or raises the operation's own error."""
        start = time.monotonic()
        deadline, next_look, pause = start + self.timeout_s, start + POLL_S, 1e-4
        try:
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
        finally:
            del work  # not kept by an error's traceback (see `broadcast`)

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
    join_timeout_s: float | None = None,
) -> WeightGroup:
    """Join generation `generation` of the weight group of `policy`; blocks until all `world_size` ranks
    have joined and the group has formed (`GroupRetired` if rank 0 retires that generation meanwhile).

    Rank 0 listens on (host, port), or re-forms the group on the TCPStore it already hosts (`store`); the
    others connect to it, retrying until `timeout_s`. `join_timeout_s` bounds the join alone (default
    `timeout_s`, which always bounds each broadcast): rank 0 waits longer for the first generation, whose
    servers may still be starting (`WeightGroupSpec.join_args`).
    """
    if backend not in WEIGHT_BACKENDS:
        raise ValueError(f"unknown weight-sync backend {backend!r}; known: {list(WEIGHT_BACKENDS)}")
    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(f"need world_size >= 2 and 0 <= rank < world_size, got rank {rank} of {world_size}")
    join_s = timeout_s if join_timeout_s is None else join_timeout_s
    try:
        return _join(
            policy=policy, backend=backend, host=host, port=port, rank=rank, world_size=world_size,
            timeout_s=timeout_s, join_s=join_s, generation=generation, tcp_store=store,
        )  # fmt: skip
    except (RuntimeError, dist.DistError) as e:
        if isinstance(e, (WeightGroupError, GroupRetired, PlacementError)):
            raise
        raise WeightGroupError(
            f"rank {rank} of policy {policy!r}'s weight group ({backend}, {world_size} ranks, store at {host}:{port}) "
            f"could not join within {join_s:g}s: {e}"
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
    join_s: float,
    generation: int,
    tcp_store: dist.Store | None,
) -> WeightGroup:
    # Reaching the store, meeting the others and forming the group share the join's bound.
    deadline = time.monotonic() + join_s
    if tcp_store is None:
        tcp_store = open_store(host, port, world_size, is_master=rank == 0, timeout_s=join_s)
    store = dist.PrefixStore(group_prefix(policy, generation), tcp_store)
    # Meet first: a rank lost before the group formed must not leave the others in its rendezvous.
    _arrive(store, policy, rank, world_size, join_s, generation, deadline)
    if backend == "nccl":
        # Two ranks on one GPU would fail inside NCCL's init, without saying which: named here first.
        check_group_gpus(store, policy, "nccl", rank, world_size, max(0.0, deadline - time.monotonic()))
        if not dist.is_nccl_available():
            raise ValueError("weight-sync backend 'nccl' needs a torch build with NCCL (use 'gloo' on CPU)")
    pg, device = _form(store, backend, host, policy, rank, world_size, timeout_s, generation, deadline, join_s)
    # Keep the TCPStore (rank 0 hosts its server) alive alongside the group.
    return WeightGroup(policy, backend, rank, world_size, device, pg, tcp_store, timeout_s, generation, store)


def _new_process_group(
    store: dist.Store, backend: str, host: str, rank: int, world_size: int, bound_s: float
) -> dist.ProcessGroup:
    """The gloo or NCCL process group object of one rank, with the library's own timeout longer than the
    code's `bound_s` (`library_timeout_s`)."""
    timeout = timedelta(seconds=library_timeout_s(bound_s))
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # Pin gloo to the address that reaches the store, not whatever the host name resolves to.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(host))]
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def _cuda_device() -> torch.device:
    """This process's GPU: where an NCCL rank's communicator and tensors live. The one it was placed on
    (`devices.process_device`: the join runs in a worker thread, whose current device is cuda:0), else the
    calling thread's current device (a vLLM worker: its engine made its GPU current there)."""
    return process_device() or torch.device("cuda", torch.cuda.current_device())


def _form(
    store: dist.Store,
    backend: str,
    host: str,
    policy: str,
    rank: int,
    world_size: int,
    timeout_s: float,
    generation: int,
    deadline: float,
    join_s: float,
) -> tuple[dist.ProcessGroup, torch.device]:
    """Construct the process group and run its first collective (a one-element broadcast from rank 0), in a
    thread this rank waits for until `deadline`, looking every POLL_S whether the generation was retired.

    gloo connects to every peer in its constructor, and NCCL creates its communicator in the first collective
    (`ncclCommInitRank`, which in its default blocking mode waits for every rank without a bound): both would
    otherwise be bounded by the library's timeout only, or by nothing. A thread still stuck there at the
    deadline is left behind (a daemon; its process is about to end on the error)."""
    formed: dict[str, Any] = {}
    done = threading.Event()
    device = torch.device("cpu") if backend == "gloo" else _cuda_device()

    def form() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            pg = formed["pg"] = _new_process_group(store, backend, host, rank, world_size, max(timeout_s, join_s))
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            probe = torch.zeros(1, dtype=torch.int64, device=device)
            work = pg.broadcast([probe], opts)
            work.wait()
            probe.cpu()  # (NCCL: the wait orders the stream; this waits for the broadcast itself)
        except BaseException as e:  # handed to the joining thread below
            formed["error"] = e
        finally:
            done.set()

    name = f"weights-{policy}-gen{generation}-form"
    threading.Thread(target=form, name=name, daemon=True).start()
    while not done.wait(POLL_S):
        if store.check([RETIRED_KEY]) or time.monotonic() >= deadline:
            pg = formed.get("pg")
            if backend == "nccl" and pg is not None:
                pg.abort()  # (an init still in progress is not in its map yet: its thread stays stuck)
            if store.check([RETIRED_KEY]):
                raise GroupRetired(
                    f"rank {rank} of policy {policy!r}'s weight group: generation {generation} was retired while it "
                    f"formed"
                )
            raise WeightGroupError(
                f"rank {rank} of policy {policy!r}'s weight group ({backend}): generation {generation} did not form "
                f"within {join_s:g}s (every rank met on the store, but the {backend} "
                f"{'connections' if backend == 'gloo' else 'communicator'} and a first broadcast were not set up in "
                f"time: a rank was lost, or cannot reach the others)"
            )
    if "error" in formed:
        raise formed["error"]
    return formed["pg"], device


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
    first_join_timeout_s: float = 300.0
    """Bound of every rank's join of the first generation, the trainer's and each server's: the servers may
    still be starting (a server up early waits for the others' engines), so the run's startup bound
    (`mas_async.startup.startup_bound_s`: longer with vLLM servers), or `timeout_s` if longer."""

    @classmethod
    def of(cls, config: Config, deployment: Deployment, policy: str) -> WeightGroupSpec:
        return cls(
            policy=policy,
            backend=deployment.weight_backend(config, policy),
            host=deployment.store_host(policy),
            port=deployment.weight_ports[policy],
            world_size=1 + config.policies[config.server_policy(policy)].replicas,
            timeout_s=config.trainer.weight_sync_timeout_s,
            first_join_timeout_s=startup_bound_s(config),
        )

    def join_args(self, rank: int, generation: int = 0, world_size: int | None = None) -> dict[str, Any]:
        """Keyword arguments of `open_weight_group` (and of a backend's `join_weight_group`) for `rank`, in
        generation `generation` of the group, of `world_size` ranks (a re-formed generation's; default: the
        first generation's, every replica of the deployment). Every rank's join of the first generation is
        bounded by `first_join_timeout_s`, the trainer's and the servers' alike (a re-formed generation is
        ordered once its replicas are up: `timeout_s`)."""
        args = {
            "policy": self.policy, "backend": self.backend, "host": self.host, "port": self.port, "rank": rank,
            "world_size": world_size or self.world_size, "timeout_s": self.timeout_s, "generation": generation,
            "join_timeout_s": max(self.timeout_s, self.first_join_timeout_s) if generation == 0 else self.timeout_s,
        }  # fmt: skip
        return args

    def open(self, rank: int) -> WeightGroup:
        """Join the torch.distributed group as `rank` (blocking until every rank has joined); gloo and
        nccl only: `mas_async.weights.sync` opens a sender or receiver of any backend."""
        return open_weight_group(**self.join_args(rank))
