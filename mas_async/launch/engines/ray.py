"""The Ray engine (`cluster.engine: ray`): places a run's processes on the nodes of a running Ray cluster
and starts each one there through a thin actor; Ray carries no messages and no weights.

    mas-async train CONFIG cluster.engine=ray [cluster.ray.address=HOST:PORT]

`RayEngine(config)` connects to an existing cluster (`cluster.ray.address`, default "auto"; it never
starts one, and an unreachable address is an `EngineError` within `CONNECT_TIMEOUT_S`). `place` reserves
one placement group with one bundle per process (the CPUs and GPUs of its role, plus custom resources per
role or process that pin it to nodes: `cluster.ray`), in `cluster.ray.strategy`, and starts a
`ProcessHost` actor in every bundle holding exactly that bundle's resources (so Ray sets the process's
CUDA_VISIBLE_DEVICES); each actor reports its node, which becomes the process's `Node` (name: the Ray
node id, address: the node's IP). `free_ports` asks an actor on the node, `start` has the actor Popen the
command there (in the launcher's working directory: the run directory must be on a shared file system),
and a `RayChild` polls, signals and waits through the actor. Every call to an actor is bounded
(`ACTOR_REPLY_S`); an actor that died means its process is gone (`ACTOR_DIED_STATUS`). `close` kills
each process group, the actors and the placement group, and disconnects.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from mas_async.config import Config, ConfigError, scheduler_gpus
from mas_async.launch.engines.base import Child, Engine, EngineError, Node, ProcessSpec
from mas_async.launch.engines.ray_host import ProcessHost

CONNECT_TIMEOUT_S = 10.0
"""The cluster's GCS address must accept a connection within this time (ray.init itself waits forever)."""
ACTOR_REPLY_S = 30.0
"""Every call to a host actor answers within this time (plus the wait it was asked for)."""
ACTOR_DIED_STATUS = -signal.SIGKILL
"""The exit status reported for a process whose host actor died (its node or worker lost): the process
shuts itself down when it sees its parent change (`PARENT_PID_ENV`), if Ray did not kill it first."""
FORWARDED_ENV_PREFIXES = ("PYTHONPATH", "MAS_ASYNC_")
"""Variables of the launcher's environment that the processes get too; the rest of their environment is the
Ray worker's. (Not given to the actors as a Ray runtime_env: that doubles their start-up time. The actors
import this package with the cluster's own Python path.)"""


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise EngineError(f"cluster.engine=ray needs Ray on this machine: pip install 'mas-async[ray]' ({e})") from e
    return ray


def connect(address: str) -> None:
    """Connect this process to the running Ray cluster at `address` ("auto" or HOST:PORT), bounded."""
    ray = _ray()
    from ray._private.services import canonicalize_bootstrap_address  # "auto" -> RAY_ADDRESS or `ray start`'s

    try:
        resolved = canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError) as e:
        raise EngineError(
            f"cluster.ray.address={address}: no running Ray cluster found ({e}); start one (`ray start --head`) "
            "or give its address as cluster.ray.address=HOST:PORT"
        ) from e
    if resolved is None:
        raise EngineError(f"cluster.ray.address={address}: names no running Ray cluster")
    host, _, port = resolved.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise EngineError(
            f"cluster.ray.address={address}: the Ray cluster at {resolved} did not accept a connection within "
            f"{CONNECT_TIMEOUT_S:.0f} s ({e})"
        ) from e
    try:
        ray.init(address=resolved, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError) as e:  # e.g. another Ray version on the cluster
        raise EngineError(f"cluster.ray.address={address}: could not join the Ray cluster at {resolved}: {e}") from e


def _forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


def bundle_of(config: Config, spec: ProcessSpec) -> dict[str, float]:
    """The resources reserved for `spec`: its role's CPUs, its GPUs (`cluster.ray.trainer_gpus` /
    `inference_gpus`, else what it computes on: `config.scheduler_gpus`, the rule of every engine), its
    role's and its own custom ones."""
    rc = config.cluster.ray
    cpus = {"router": rc.router_cpus, "trainer": rc.trainer_cpus}
    cpus |= {"inference": rc.inference_cpus, "env_worker": rc.env_worker_cpus}
    gpus = scheduler_gpus(config, spec.name) or 0.0
    custom = {**rc.resources.get(spec.role, {}), **rc.resources.get(spec.name, {})}
    resources = {"CPU": cpus[spec.role], "GPU": gpus, **custom}
    return {key: amount for key, amount in resources.items() if amount > 0}


class RayChild(Child):
    """A process of the run started by its `ProcessHost` actor; every call goes through that actor."""

    def __init__(self, name: str, node: Node, log_path: Path, host: Any, pid: int) -> None:
        super().__init__(name, node, log_path)
        self.host = host
        self._pid = pid
        self._status: int | None = None
        self.actor_died = False

    @property
    def pid(self) -> int:
        return self._pid

    def where(self) -> str:
        return super().where() + (", whose Ray actor died" if self.actor_died else "")

    def poll(self) -> int | None:
        if self._status is None:
            self._status = self._ask("poll", ACTOR_REPLY_S)
        return self._status

    def terminate(self) -> None:
        if self.poll() is None:
            self._ask("signal", ACTOR_REPLY_S, signal.SIGTERM)

    def kill(self) -> None:
        # The group may hold grandchildren (sandboxes) even after the process itself exited.
        self._ask("signal", ACTOR_REPLY_S, signal.SIGKILL)

    def wait(self, timeout: float) -> int | None:
        if self._status is None:
            self._status = self._ask("wait", timeout + ACTOR_REPLY_S, timeout)
        return self._status

    def _ask(self, method: str, timeout: float, *args: Any) -> Any:
        """Call the host actor; a dead actor means the process is gone (`ACTOR_DIED_STATUS`)."""
        ray = _ray()
        try:
            return ray.get(getattr(self.host, method).remote(*args), timeout=timeout)
        except ray.exceptions.RayActorError:
            self.actor_died = True
            return ACTOR_DIED_STATUS
        except ray.exceptions.GetTimeoutError as e:
            raise EngineError(
                f"the Ray actor running {self.name} on node {self.node.name} did not answer {method} within "
                f"{timeout:.0f} s"
            ) from e


class RayEngine(Engine):
    def __init__(self, config: Config) -> None:
        cluster = config.cluster
        if cluster.nodes or cluster.placement:
            raise ConfigError(
                "cluster.nodes and cluster.placement are the local engine's; with cluster.engine=ray, Ray picks "
                "the nodes: pin roles with custom resources, cluster.ray.resources.ROLE.RESOURCE=AMOUNT"
            )
        self.config = config
        self.ray_config = cluster.ray
        self.group_name = f"mas-async/{config.run.name}/{os.getpid()}"
        self.group: Any = None
        self.hosts: dict[str, Any] = {}  # process name -> its ProcessHost actor
        self.nodes: dict[str, Node] = {}  # process name -> the node its actor runs on
        connect(self.ray_config.address)

    def place(self, specs: list[ProcessSpec]) -> dict[str, Node]:
        if self.group is not None and set(self.nodes) == {spec.name for spec in specs}:
            return dict(self.nodes)  # a run restarted from its checkpoint: the same hosts, still reserved
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        timeout = self.ray_config.placement_timeout_s
        deadline = time.monotonic() + timeout
        bundles = [bundle_of(self.config, spec) for spec in specs]
        self.group = placement_group(bundles, strategy=self.ray_config.strategy, name=self.group_name)
        if not self.group.wait(timeout_seconds=timeout):
            raise EngineError(self._unplaced(specs, bundles))
        host_class = ray.remote(ProcessHost)
        for index, (spec, bundle) in enumerate(zip(specs, bundles, strict=True)):
            self.hosts[spec.name] = host_class.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index),
                max_restarts=0,
            ).remote()
        replies = {name: host.node.remote() for name, host in self.hosts.items()}
        left = max(0.0, deadline - time.monotonic())
        _, pending = ray.wait(list(replies.values()), num_returns=len(replies), timeout=left)
        if pending:
            late = [name for name, ref in replies.items() if ref in pending]
            raise EngineError(
                f"the Ray actors that start {', '.join(late)} were not up within cluster.ray.placement_timeout_s="
                f"{timeout:g} s (their resources were reserved; see `ray status` and the actors' worker logs)"
            )
        for name, ref in replies.items():
            address, node_id = self._get(ref, f"report the node of {name}")
            self.nodes[name] = Node(node_id, address)
        return dict(self.nodes)

    def _unplaced(self, specs: list[ProcessSpec], bundles: list[dict[str, float]]) -> str:
        """Why the placement group was not ready in time: the bundles no node could hold, else the whole."""
        ray = _ray()
        totals = [node["Resources"] for node in ray.nodes() if node["Alive"]]
        nowhere = [
            f"{spec.name} {bundle}"
            for spec, bundle in zip(specs, bundles, strict=True)
            if not any(all(total.get(k, 0) >= v for k, v in bundle.items()) for total in totals)
        ]
        where = f"cluster.ray.placement_timeout_s={self.ray_config.placement_timeout_s:g} s"
        if nowhere:
            return f"Ray could not place the run within {where}: no node of the cluster has {'; '.join(nowhere)}"
        return (
            f"Ray could not place the run's {len(specs)} processes within {where} with strategy "
            f"{self.ray_config.strategy}: each fits a node, but not all at once (free now: "
            f"{ray.available_resources()}); lower the cluster.ray CPUs/GPUs or add nodes"
        )

    def gpu_view(self, spec: ProcessSpec, node: Node) -> str:
        """A process whose bundle reserves GPUs sees only its own (Ray sets its CUDA_VISIBLE_DEVICES): its view
        is its own; the others see their node's GPUs."""
        return spec.name if (scheduler_gpus(self.config, spec.name) or 0.0) > 0 else node.name

    def free_ports(self, node: Node, count: int) -> list[int]:
        host = next(self.hosts[name] for name, on in self.nodes.items() if on == node)
        return self._get(host.free_ports.remote(node.address, count), f"find free ports on node {node.name}")

    def start(self, spec: ProcessSpec, node: Node, command: list[str], env: dict[str, str], log_path: Path) -> Child:
        assert self.nodes[spec.name] == node, f"{spec.name} was placed on {self.nodes[spec.name]}, not {node}"
        host = self.hosts[spec.name]
        started = host.start.remote(command, {**_forwarded_env(), **env}, str(log_path), os.getcwd())
        pid = self._get(started, f"start {spec.name} on node {node.name} ({node.address})")
        return RayChild(spec.name, node, log_path, host, pid)

    def _get(self, ref: Any, what: str) -> Any:
        """The reply of a host actor, within `ACTOR_REPLY_S`; a failure is an `EngineError` saying `what`."""
        ray = _ray()
        try:
            return ray.get(ref, timeout=ACTOR_REPLY_S)
        except ray.exceptions.RayTaskError as e:
            raise EngineError(f"could not {what}: {e.cause!r}") from e
        except ray.exceptions.RayActorError as e:
            raise EngineError(f"could not {what}: its Ray actor died ({e})") from e
        except ray.exceptions.GetTimeoutError as e:
            raise EngineError(f"could not {what}: its Ray actor did not answer within {ACTOR_REPLY_S:.0f} s") from e

    def close(self) -> None:
        """Kill every process group (a backstop: the launcher stopped them), the actors, the placement group."""
        ray = _ray()
        if not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group

        stops = [host.stop.remote() for host in self.hosts.values()]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=ACTOR_REPLY_S)
        for host in self.hosts.values():
            ray.kill(host, no_restart=True)
        self.hosts.clear()
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None
        ray.shutdown()
