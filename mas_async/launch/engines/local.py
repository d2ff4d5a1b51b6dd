"""The local engine: every process is a subprocess of the launcher, on this machine or in a node that a
command prefix reaches with this machine's file system (a network namespace: `nsenter --net=...`).

Nodes come from `cluster.nodes` (default: one node at `cluster.host`); `cluster.placement` puts a role or
one process on a node by name (default: the first node). The nodes share this machine's GPUs: the launcher
plans which each process holds (`mas_async.gpu_plan`) and gives a process with GPUs of its own (a device
`cuda`, a vLLM server) its CUDA_VISIBLE_DEVICES. With `cluster.fork_server` (the default) each
node's processes are forks of that node's fork server (`fork_server.py`), which imported torch and the
actors once (or a fork of a preloaded template that the environment names: `fork_template.py`);
otherwise each is a new interpreter. Each child runs in its own session, so stopping it
signals its process group (its sandboxes and engine workers too).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from mas_async.config import Config
from mas_async.deployment import free_ports, hold_ports
from mas_async.launch import fork_template, process
from mas_async.launch.engines.base import Child, Engine, EngineError, Node, ProcessSpec
from mas_async.launch.fork_server import ForkServer
from mas_async.placement import machine_gpu_uuids

FREE_PORTS_TIMEOUT_S = 30.0


class LocalChild(Child):
    """A child started as a new interpreter (`subprocess.Popen`)."""

    def __init__(self, name: str, node: Node, log_path: Path, proc: subprocess.Popen) -> None:
        super().__init__(name, node, log_path)
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        # The group may hold grandchildren (sandboxes) even after the child itself exited.
        _signal_group(self.proc.pid, signal.SIGKILL)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None


class ForkedChild(Child):
    """A child forked by its node's fork server, which tells its exit status and, on a node reached by a
    command prefix, delivers its signals there (its pid means nothing on this machine)."""

    def __init__(self, name: str, node: Node, log_path: Path, server: ForkServer, pid: int) -> None:
        super().__init__(name, node, log_path)
        self.server = server
        self._pid = pid

    @property
    def pid(self) -> int:
        return self._pid

    def poll(self) -> int | None:
        return self.server.returncode(self._pid)

    def terminate(self) -> None:
        if self.poll() is None:
            self.server.signal(self._pid, signal.SIGTERM)

    def kill(self) -> None:
        self.server.signal(self._pid, signal.SIGKILL)

    def wait(self, timeout: float) -> int | None:
        return self.server.wait(self._pid, timeout)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class LocalEngine(Engine):
    def __init__(self, config: Config) -> None:
        cluster = config.cluster
        self.nodes = [Node(n.name, n.address) for n in cluster.nodes] or [Node("local", cluster.host)]
        self.prefixes = {n.name: list(n.prefix) for n in cluster.nodes}
        self.placement = dict(cluster.placement)
        self.use_fork_server = cluster.fork_server
        self.startup_timeout_s = cluster.startup_timeout_s
        self.fork_servers: dict[str, ForkServer] = {}
        self.held: list[socket.socket] = []
        """Ports kept for the run's external gateways (`hold_ports`), released by `close`."""
        self._uuids: list[list[str] | None] | None = None
        """This machine's GPU UUIDs, asked once (`placement.machine_gpu_uuids`), when a process is on a GPU."""

    def place(self, specs: list[ProcessSpec]) -> dict[str, Node]:
        by_name = {n.name: n for n in self.nodes}
        return {
            s.name: by_name[self.placement.get(s.name, self.placement.get(s.role, self.nodes[0].name))] for s in specs
        }

    def gpu_view(self, spec: ProcessSpec, node: Node) -> str:
        """This machine's, named as its GPU pool: its nodes (network namespaces) share its GPUs."""
        return self.gpu_pool(spec, node)

    def gpu_pool(self, spec: ProcessSpec, node: Node) -> str:
        """This machine's GPUs, which all its nodes share: named by its node (nodes, with several)."""
        return "+".join(n.name for n in self.nodes)

    def gpu_count(self, pool: str) -> int | None:
        """This machine's GPUs (`placement.machine_gpu_uuids`; None when that cannot be told)."""
        uuids = self.gpu_uuids(pool)
        return None if uuids is None else len(uuids)

    def gpu_uuids(self, view: str) -> list[str] | None:
        if self._uuids is None:
            self._uuids = [machine_gpu_uuids()]
        return self._uuids[0]

    def free_ports(self, node: Node, count: int) -> list[int]:
        prefix = self.prefixes.get(node.name)
        if not prefix:
            return free_ports(node.address, count)
        code = f"import json; from mas_async.deployment import free_ports; print(json.dumps(free_ports({node.address!r}, {count})))"
        out = subprocess.run(
            [*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=FREE_PORTS_TIMEOUT_S
        )
        if out.returncode != 0:
            why = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]  # the exception line
            raise EngineError(f"could not find free ports on node {node.name} ({node.address}): {why}")
        return json.loads(out.stdout)

    def start(self, spec: ProcessSpec, node: Node, command: list[str], env: dict[str, str], log_path: Path) -> Child:
        if self.use_fork_server and command[:3] == [sys.executable, "-m", process.__name__]:
            server = self._fork_server(node, env, log_path.parent)
            pid = server.start(spec.name, command[3:], {**os.environ, **env}, log_path)
            return ForkedChild(spec.name, node, log_path, server, pid)
        with log_path.open("ab") as log_file:
            proc = subprocess.Popen(
                [*self.prefixes.get(node.name, []), *command],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **env},
            )
        return LocalChild(spec.name, node, log_path, proc)

    def _fork_server(self, node: Node, env: dict[str, str], logs: Path) -> ForkServer:
        if node.name not in self.fork_servers:
            prefix = self.prefixes.get(node.name, [])
            log_path = logs / f"fork-server-{node.name}.log"
            server = None if prefix else fork_template.connect(node.name, log_path, self.startup_timeout_s)
            self.fork_servers[node.name] = server or ForkServer.spawn(
                node.name, prefix, env, log_path, self.startup_timeout_s
            )
        return self.fork_servers[node.name]

    def hold_ports(self, node: Node, count: int) -> list[int]:
        if self.prefixes.get(node.name):  # (a network namespace: its ports are not this process's to hold)
            return self.free_ports(node, count)
        sockets = hold_ports(node.address, count)
        self.held += sockets
        return [s.getsockname()[1] for s in sockets]

    def close(self) -> None:
        for server in self.fork_servers.values():
            server.close()
        self.fork_servers.clear()
        for held in self.held:
            held.close()
        self.held.clear()
