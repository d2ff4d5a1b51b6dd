"""Where the processes of one run find each other: endpoints, ports and model folders.

The launcher allocates these once and writes RUN_DIR/deployment.json beside the resolved config; every
process reads both at start. Keeping them out of the config keeps the resolved config reproducible.

The record sits above what it records: the places and weight backends come from `mas_async.placement`, the
process names from `mas_async.peer_names`; neither imports this module.
"""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mas_async.peer_names import trainer_peer

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

    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """process name -> its place (`mas_async.placement.Place`): "node" (its node's name), "address" (what it
    binds to and advertises), "device" (as the process names it; "" for a vLLM server on GPUs, which is never
    handed one), "gpu" (its GPU's UUID, or `<view>/cuda:N` where not known before the process starts; "" on
    the CPU), "gpus" (the indices of its node's GPUs it holds, `mas_async.gpu_plan`), "cuda_visible_devices"
    (what the launcher sets, "" for none) and "share" (its share of its GPUs' memory where it shares them)."""
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


def hold_ports(host: str, count: int) -> list[socket.socket]:
    """Sockets bound to `count` distinct free ports of `host` and kept so, not listening, with SO_REUSEPORT.
    `free_ports` releases its ports at once, and another local process may take one before its listener binds
    it; while a held socket is open, only a process of the same user that also sets SO_REUSEPORT (the listener
    it is held for) can bind its port (Linux's rule), and no connection reaches it (it does not listen)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((host, 0))
    except BaseException:
        for s in sockets:
            s.close()
        raise
    return sockets


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
