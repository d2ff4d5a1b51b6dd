"""What an engine is: it places a run's processes on nodes, starts them there, watches and stops them.

The launcher builds the list of processes (`ProcessSpec`, router first) and the command line of each; an
engine decides the node of every process (`place`), finds free ports on a node for its listeners
(`free_ports`), starts a process on its node (`start`, giving a `Child`) and releases what it holds
(`close`). Engines carry no messages and no weights: the processes talk ZeroMQ and torch.distributed
directly, to the addresses the placement gave them (deployment.json).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path


class EngineError(RuntimeError):
    """An engine could not do what the run needs (join its cluster, place, reach or start a process); the
    message names what and where."""


@dataclass(frozen=True)
class Node:
    """A machine (or network namespace) processes run on."""

    name: str
    address: str
    """The address its processes bind their listeners to and advertise to the others."""


@dataclass(frozen=True)
class ProcessSpec:
    """One process of a run."""

    name: str
    """Its peer id: router, trainer/P, trainer/P/R, inference/P/I, env_worker/I."""
    role: str
    """router, trainer, inference or env_worker (the key of the role -> factory map)."""
    args: tuple[str, ...]
    """Arguments of `python -m mas_async.launch.process` after ROLE and RUN_DIR (index, policy)."""
    policy: str = ""


class Child(ABC):
    """A started process of the run, wherever it runs."""

    def __init__(self, name: str, node: Node, log_path: Path) -> None:
        self.name = name
        self.node = node
        self.log_path = log_path

    @property
    @abstractmethod
    def pid(self) -> int | None:
        """Its process id on its node (for messages), None if unknown."""

    @abstractmethod
    def poll(self) -> int | None:
        """Its exit status, or None while it runs."""

    @abstractmethod
    def terminate(self) -> None:
        """Ask it (and every process it started) to stop: SIGTERM."""

    @abstractmethod
    def kill(self) -> None:
        """Stop it and every process it started now: SIGKILL. Safe to call after it exited."""

    @abstractmethod
    def wait(self, timeout: float) -> int | None:
        """Its exit status once it exits, None if it still runs after `timeout` seconds."""

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def where(self) -> str:
        """'pid N on NODE' for messages."""
        return f"pid {self.pid} on {self.node.name}" if self.pid is not None else f"on {self.node.name}"


class Engine(ABC):
    """Places, starts, watches and stops the processes of one run."""

    @abstractmethod
    def place(self, specs: list[ProcessSpec]) -> dict[str, Node]:
        """The node of every process (by name)."""

    @abstractmethod
    def free_ports(self, node: Node, count: int) -> list[int]:
        """`count` distinct ports that are free now on `node`'s address."""

    @abstractmethod
    def start(self, spec: ProcessSpec, node: Node, command: list[str], env: dict[str, str], log_path: Path) -> Child:
        """Start `command` (with the extra environment `env`) as process `spec` on `node`, its output
        (stdout and stderr) into `log_path`."""

    def gpu_view(self, spec: ProcessSpec, node: Node) -> str:
        """Whose GPU numbering `spec`'s process on `node` uses (its cuda:0, cuda:1, ...): two processes of one
        view that name one device use one GPU, processes of two views use two GPUs (`mas_async.placement`).
        Default: the node's, for engines whose processes all see their node's GPUs."""
        return node.name

    def gpu_pool(self, spec: ProcessSpec, node: Node) -> str:
        """Whose GPUs `spec`'s process on `node` holds some of (`mas_async.gpu_plan`): its node's (the default),
        or one machine's for nodes that share its GPUs."""
        return node.name

    def gpu_count(self, pool: str) -> int | None:
        """How many GPUs `pool` has, where the engine can tell before any process starts; None (the default)
        where it cannot: its scheduler then refuses what does not fit (a SLURM job asks for what its steps
        hold; a Ray placement group waits for it)."""
        return None

    def gpu_uuids(self, view: str) -> list[str] | None:
        """The UUIDs of the GPUs of `view`, in CUDA order, where the engine can tell before any process
        starts; None (the default) where it cannot: the places then name a GPU by view and index, and the
        processes check their real GPUs when their weight groups form."""
        return None

    def hold_ports(self, node: Node, count: int) -> list[int]:
        """`count` distinct free ports of `node` that the engine keeps from other users' processes until it
        closes (`deployment.hold_ports`), for a listener that binds its port with SO_REUSEPORT (an external
        gateway, which a secret is sent to); where the engine cannot hold them (another machine), free ones."""
        return self.free_ports(node, count)

    def close(self) -> None:
        """Release whatever the engine holds (placement groups, connections); the children are stopped."""
        return None
