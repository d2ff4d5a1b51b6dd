"""The local engine: every process is a subprocess of the launcher, on this machine or in a node that a
command prefix reaches with this machine's file system (a network namespace: `nsenter --net=...`).

Nodes come from `cluster.nodes` (default: one node at `cluster.host`); `cluster.placement` puts a role or
one process on a node by name (default: the first node). Each child runs in its own session, so stopping
it signals its process group (its sandboxes and engine workers too).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from mas_async.config import Config
from mas_async.deployment import free_ports
from mas_async.launch.engines.base import Child, Engine, EngineError, Node, ProcessSpec

FREE_PORTS_TIMEOUT_S = 30.0


class LocalChild(Child):
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

    def place(self, specs: list[ProcessSpec]) -> dict[str, Node]:
        by_name = {n.name: n for n in self.nodes}
        return {
            s.name: by_name[self.placement.get(s.name, self.placement.get(s.role, self.nodes[0].name))] for s in specs
        }

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
