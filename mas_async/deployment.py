"""Where the processes of one run find each other: endpoints, ports and model folders.

The launcher allocates these once and writes RUN_DIR/deployment.json beside the resolved config; every
process reads both at start. Keeping them out of the config keeps the resolved config reproducible.
"""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mas_async.config import Config


@dataclass
class Deployment:
    router_endpoint: str
    """ZMQ endpoint the router binds and every peer connects to, e.g. tcp://127.0.0.1:41234."""
    weight_ports: dict[str, int]
    """policy -> TCPStore port of its weight-sync group (hosted by the policy's trainer)."""
    model_paths: dict[str, str]
    """policy -> local model folder (materialised once by the launcher)."""
    start_version: int = 0
    """Weight version every process starts at (0, or the checkpoint a resumed run starts from)."""
    training: bool = True
    """False for `mas-async eval`: no trainers, no weight groups, one evaluation pass."""
    weights_paths: dict[str, str] = field(default_factory=dict)
    """policy -> checkpoint folder whose weights replace the model folder's (resumed runs only)."""
    trainer_ports: dict[str, int] = field(default_factory=dict)
    """policy -> TCPStore port of the group of its trainer ranks (policies with trainer_ranks >= 2)."""

    nodes: dict[str, dict[str, str]] = field(default_factory=dict)
    """process name -> its place (`mas_async.placement.Place`): "node" (its node's name), "address" (what it
    binds to and advertises), "device" (as the process names it; "" when its engine picks the GPU) and
    "gpu" (the GPU's UUID, or `<view>/cuda:N` where not known before the process starts; "" on the CPU)."""
    weight_backends: dict[str, str] = field(default_factory=dict)
    """policy -> how its trainer sends its weights to its servers (gloo, nccl, cuda_ipc), decided once from
    the places (`mas_async.placement.weight_backend`)."""
    keys_dir: str | None = None
    """The run's CURVE keys folder (RUN_DIR/keys, `mas_async.runtime.curve`), None when cluster.curve is off:
    then every socket is plain."""
    gateways: dict[str, str] = field(default_factory=dict)
    """env worker -> the base URL of its gateway, http://<its node's address>:<port>/v1, which it binds
    (`gateway.external` only: what a process outside the run calls; empty otherwise)."""
    gateway_token: str | None = None
    """The file of the run's gateway token (RUN_DIR/keys/gateway_token, mode 0600, `mas_async.gateway.access`),
    which every request to an external gateway carries; None unless `gateway.external`."""

    def address(self, process: str) -> str:
        """The address of the node `process` runs on (127.0.0.1 for a deployment without nodes)."""
        return self.nodes[process]["address"] if process in self.nodes else "127.0.0.1"

    def store_host(self, policy: str) -> str:
        """Where `policy`'s weight-sync and trainer-rank stores listen: its trainer rank 0's node."""
        return self.address(trainer_peer(policy, 0))

    def weight_backend(self, config: Config, policy: str) -> str:
        """How `policy`'s weights travel: as decided at launch; a deployment that names no places (built by
        hand, in a test or a benchmark) is one machine's (`mas_async.placement.one_machine`)."""
        if policy in self.weight_backends:
            return self.weight_backends[policy]
        from mas_async.placement import one_machine, weight_backend

        return weight_backend(config, policy, one_machine(config, self.training))

    def weights_path(self, policy: str) -> str:
        """Where the policy's starting weights are: its checkpoint when resuming, else its model folder."""
        return self.weights_paths.get(policy, self.model_paths[policy])

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> Deployment:
        return cls(**json.loads(path.read_text()))


def http_url(address: str, port: int, path: str = "") -> str:
    """http://address:port/path, an IPv6 address in brackets."""
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}{path}"


def trainer_peer(policy: str, rank: int = 0) -> str:
    """The peer id (socket identity) of trainer rank `rank` of `policy`: trainer/P, then trainer/P/R."""
    return f"trainer/{policy}" if rank == 0 else f"trainer/{policy}/{rank}"


def replica_names(config: Config, policy: str, training: bool = True) -> list[str]:
    """The peer ids of `policy`'s own inference replicas, inference/P/R (none when it is served on another
    policy's base, `policies.<p>.base`)."""
    if config.server_policy(policy, training) != policy:
        return []
    return [f"inference/{policy}/{r}" for r in range(config.policies[policy].replicas)]


def trainer_rank(peer: str) -> int:
    """The rank of a trainer peer id (`trainer_peer`'s inverse)."""
    parts = peer.split("/")
    return int(parts[2]) if len(parts) > 2 else 0


def free_ports(host: str, count: int) -> list[int]:
    """Ports that are free now on `host` (held open together so they are distinct)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
