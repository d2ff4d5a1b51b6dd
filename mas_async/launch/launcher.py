"""The launcher: places every process of a run on a node, starts them, watches them, tears them down.

`launch(config)` prepares the run directory (resolved config, one log file per process), materialises
built-in models once, asks the engine of `cluster.engine` (`mas_async.launch.engines`: local
subprocesses, Ray or SLURM) where each process runs, writes deployment.json (every process's node and
address, the listeners' endpoints and ports, model folders), then starts the router, `trainer_ranks`
trainers and `replicas` inference servers per policy and `cluster.env_workers` env workers, each as
`python -m mas_async.launch.process ROLE ...` (the actor comes from a role -> factory map,
`mas_async.launch.roles.ROLES`; benchmarks start their own actors through the same functions). It shows
live progress from metrics.jsonl. A lost env worker or inference replica is started again (the router
runs its episodes or requests elsewhere meanwhile); a lost trainer or router restarts the whole run from
its last complete checkpoint; both within `cluster.max_restarts` per role (`restarts.py`, docs/faults.md). Any
other failure, or one past that budget, stops every other process and names the failed role with its node
and the tail of its log; the exit status is non-zero. Ctrl-C (or SIGTERM) stops everything within seconds:
SIGTERM to each child and what it started, SIGKILL after a grace period, then the engine releases what it
holds.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from mas_async.checkpoint import complete_versions, latest_complete, load_best, policy_checkpoint
from mas_async.config import Config, ConfigError, dump_config, load_config
from mas_async.deployment import Deployment, http_url
from mas_async.gateway.access import mint_token
from mas_async.gpu_plan import GPU_SHARE_ENV, plan_gpus
from mas_async.inference.backends.vllm_args import check_engine_args
from mas_async.launch.code_version import record_commit
from mas_async.launch.engines.base import Child, Engine, Node, ProcessSpec
from mas_async.launch.engines.local import LocalEngine
from mas_async.launch.engines.registry import open_engine
from mas_async.launch.loadable import check_loadable
from mas_async.launch.progress import Progress
from mas_async.launch.restarts import RESTART_THE_RUN, RestartBudget, RunRestarts
from mas_async.launch.roles import DEFAULT_ROLES
from mas_async.launch.stop_signal import STOPPED, StopOnSignal
from mas_async.model_source import model_cache_dir
from mas_async.peer_names import trainer_peer
from mas_async.placement import Place, describe, place_processes, replica_names, weight_backends
from mas_async.router.faults import RUN_RESTART_ENV, replaced_alone
from mas_async.router.lost_peers import LostPeers, forget_restarts, record_restart
from mas_async.runtime.actor import DIED_AT_ENV
from mas_async.runtime.curve import SECRET_ENV, issued_secret, prepare_keys
from mas_async.runtime.run_failed import RUN_FAILED_STATUS

CLEAN_EXIT_GRACE_S = 10.0
KILLED_WAIT_S = 5.0
"""How long a process killed on the router's word may take to be seen dead."""


def prepare_run_dir(config: Config, again: bool = False) -> Path:
    """The run directory with the resolved config and the code's commit (`code_version`); `again`: it may
    hold an earlier start of this run that reached no checkpoint (a requeued SLURM job), whose rows the
    router redoes from iteration 0."""
    if config.run.output_dir is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        config.run.output_dir = f"runs/{config.run.name}/{stamp}"
    run_dir = config.output_dir()
    if (run_dir / "metrics.jsonl").exists() and not again:
        raise ConfigError(f"run directory {run_dir} already holds a run; choose another run.output_dir")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    dump_config(config, run_dir / "config.yaml")
    record_commit(run_dir)
    return run_dir


def prepare_resume(config: Config) -> tuple[Config, Path, int]:
    """The saved config, run directory and version a `resume=RUN_DIR` run continues from."""
    run_dir = Path(config.resume or "")
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"resume={run_dir}: no run there (its config.yaml is missing)")
    saved = load_config(run_dir / "config.yaml")
    version = latest_complete(run_dir, list(saved.policies))
    if version is None:
        raise ConfigError(f"resume={run_dir}: the run has no complete checkpoint to resume from")
    if version >= saved.run.iterations:
        raise ConfigError(f"resume={run_dir}: the run already finished all {saved.run.iterations} iterations")
    print(f"mas-async: resuming {run_dir} from its checkpoint of version {version}")
    record_commit(run_dir, resumed_at=version)
    return saved, run_dir, version


def check_checkpoint_matches(config: Config, source: Path) -> None:
    """A checkpoint's run must have the config's policies with the same models; else a sentence."""
    saved_path = source / "config.yaml"
    if not saved_path.is_file():
        return  # a bare checkpoint folder: its files are checked when they are looked for
    saved = load_config(saved_path)
    if set(saved.policies) != set(config.policies):
        raise ConfigError(
            f"checkpoint={source} does not match the config: its policies are {sorted(saved.policies)}, "
            f"the config's {sorted(config.policies)}"
        )
    for name, spec in config.policies.items():
        if saved.policies[name].model != spec.model:
            raise ConfigError(
                f"checkpoint={source} does not match the config: policy {name!r} was trained from "
                f"{saved.policies[name].model!r}, the config names {spec.model!r}"
            )


def eval_weights(config: Config) -> tuple[dict[str, str], int]:
    """policy -> weights folder for `mas-async eval`, and the version they hold (0 for the base models)."""
    weights, version = {}, 0
    if config.eval.checkpoint:
        source = Path(config.eval.checkpoint)
        check_checkpoint_matches(config, source)
        found = latest_complete(source, list(config.policies))
        if found is None:
            raise ConfigError(f"eval.checkpoint={source}: no complete checkpoint there")
        if config.eval.pick == "best":
            best = load_best(source)
            if best is None or best["version"] not in complete_versions(source, list(config.policies)):
                raise ConfigError(f"eval.checkpoint={source} eval.pick=best: the run recorded no best checkpoint")
            found = best["version"]
        version = found
        weights = {p: str(policy_checkpoint(source, p, found)) for p in config.policies}
    for policy, path in config.eval.weights.items():
        if policy not in config.policies:
            raise ConfigError(f"eval.weights.{policy}: no such policy (policies: {', '.join(config.policies)})")
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"eval.weights.{policy}={path}: not a model folder (no config.json)")
        weights[policy] = path
    return weights, version


def prepare_deployment(
    config: Config,
    run_dir: Path,
    start_version: int = 0,
    training: bool = True,
    weights: dict[str, str] | None = None,
    engine: Engine | None = None,
) -> Deployment:
    """Place every process on a node (the engine decides), record where each one is and decide what follows
    from it (`mas_async.placement`: each process's GPU, each policy's weight backend), take the listeners'
    ports on their nodes, and write deployment.json: the router listens on its node, each policy's stores on
    its trainer rank 0's, and with `gateway.external` each env worker's gateway on its own node, whose
    requests carry the run token minted here (`mas_async.gateway.access`)."""
    from mas_async.model_source import resolve_model

    engine = engine or LocalEngine(config)
    specs = process_specs(config, training)
    keys_dir = prepare_keys(config, run_dir, [spec.name for spec in specs])
    placement, places = place_specs(config, engine, specs)
    backends = weight_backends(config, places, training)  # a ConfigError before any process starts
    policies = list(config.policies)
    listeners = {"router": 1, **{trainer_peer(p): 2 for p in policies}}  # a policy's weight and rank stores
    workers = [spec.name for spec in specs if spec.role == "env_worker"]
    ports: dict[str, list[int]] = {}
    if config.gateway.external and not config.gateway.port:  # each external gateway on a free port of its node,
        for name in workers:  # held for the run from other users' processes (the worker binds it with SO_REUSEPORT)
            ports[name] = engine.hold_ports(placement[name], 1)
    # Without trainers (eval) nothing listens on a policy's ports; they are taken on the router's node.
    node_of = {name: placement.get(name, placement["router"]) for name in listeners}
    for node in set(node_of.values()):
        on_node = [name for name in listeners if node_of[name] == node]
        free = engine.free_ports(node, sum(listeners[name] for name in on_node))
        for name in on_node:
            ports[name], free = free[: listeners[name]], free[listeners[name] :]
    gateways: dict[str, str] = {}
    if config.gateway.external:  # (gateway.port: worker i takes port + i, as on loopback)
        for i, name in enumerate(workers):
            port = config.gateway.port + i if config.gateway.port else ports[name][0]
            gateways[name] = http_url(placement[name].address, port, "/v1")
    paths = {  # resolved once here (a hub id: its snapshot in the hub's cache); every process loads the folder
        name: str(resolve_model(spec.model, model_cache_dir(), spec.revision, policy=name))
        for name, spec in config.policies.items()
    }
    deployment = Deployment(
        router_endpoint=f"tcp://{placement['router'].address}:{ports['router'][0]}",
        weight_ports={p: ports[trainer_peer(p)][0] for p in policies},
        trainer_ports={p: ports[trainer_peer(p)][1] for p in policies},
        model_paths=paths,
        start_version=start_version,
        weights_paths={p: str(policy_checkpoint(run_dir, p, start_version)) for p in paths} if start_version else {},
        training=training,
        nodes=describe(places),
        weight_backends=backends,
        keys_dir=keys_dir,
        gateways=gateways,
        gateway_token=str(mint_token(run_dir)) if config.gateway.external else None,
    )
    if weights is not None:
        deployment.weights_paths = weights
    deployment.save(run_dir / "deployment.json")
    return deployment


def place_specs(
    config: Config,
    engine: Engine,
    specs: list[ProcessSpec],
    gpu_count: Callable[[str], int | None] | None = None,
    gpu_uuids: Callable[[str], list[str] | None] | None = None,
) -> tuple[dict[str, Node], dict[str, Place]]:
    """The engine's node for every process, the GPUs each one holds (`mas_async.gpu_plan`: of its own unless the
    config asks to share; more than a node has is a ConfigError) and each process's `Place` from there.
    `gpu_count(pool)` and `gpu_uuids(view)`: how many GPUs each node (or machine) has and their UUIDs; default
    the engine's (`Engine.gpu_count`, `Engine.gpu_uuids`); a dry run plans for the job's nodes instead."""
    placement = engine.place(specs)
    by_name = {spec.name: spec for spec in specs}
    check_engine_args(config, [s.name for s in specs if s.role == "inference"], any(s.role == "trainer" for s in specs))
    plan = plan_gpus(
        config,
        [spec.name for spec in specs],
        lambda name: engine.gpu_pool(by_name[name], placement[name]),
        gpu_count or engine.gpu_count,
    )
    places = place_processes(
        config,
        {name: (node.name, node.address) for name, node in placement.items()},
        lambda name: engine.gpu_view(by_name[name], placement[name]),
        gpu_uuids or engine.gpu_uuids,
        plan,
    )
    return placement, places


def process_specs(config: Config, training: bool = True) -> list[ProcessSpec]:
    """Every process of the run, router first; trainers only when training."""
    specs = [ProcessSpec("router", "router", ())]
    for policy, spec in config.policies.items():
        for rank in range(spec.trainer_ranks if training else 0):
            args = ("--policy", policy, "--index", str(rank))
            specs.append(ProcessSpec(trainer_peer(policy, rank), "trainer", args, policy))
        for r, name in enumerate(replica_names(config, policy, training)):
            specs.append(ProcessSpec(name, "inference", ("--policy", policy, "--index", str(r)), policy))
    for i in range(config.cluster.env_workers):
        specs.append(ProcessSpec(f"env_worker/{i}", "env_worker", ("--index", str(i))))
    return specs


@dataclass(frozen=True)
class ProcessLaunch:
    """Everything needed to start one process of the deployment (again, when it is lost)."""

    spec: ProcessSpec
    node: Node
    command: list[str]
    env: dict[str, str]
    log_path: Path

    def start(self, engine: Engine, extra_env: dict[str, str] | None = None) -> Child:
        return engine.start(self.spec, self.node, self.command, {**self.env, **(extra_env or {})}, self.log_path)


def process_launches(
    config: Config,
    run_dir: Path,
    training: bool = True,
    *,
    roles: str = DEFAULT_ROLES,
    options: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> list[ProcessLaunch]:
    """Every process of the deployment on its node (deployment.json), router first, each as
    `python -m mas_async.launch.process` building its actor from the role map `roles` ("module:ATTR"; a
    benchmark passes its own) with the keyword `options`, with the extra environment `env` and its own
    CURVE secret key (made by `prepare_deployment` in this process) and the GPUs its place gives it
    (`gpu_environment`); one log each."""
    deployment = Deployment.load(run_dir / "deployment.json")
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(config.cluster.torch_threads), **(env or {})}
    extra = ["--roles", roles, "--options", json.dumps(options or {})]
    launches = []
    for spec in process_specs(config, training):
        place = deployment.nodes[spec.name]
        command = [sys.executable, "-m", "mas_async.launch.process", spec.role, str(run_dir), *spec.args, *extra]
        log_path = run_dir / "logs" / f"{spec.name.replace('/', '-')}.log"
        own = {SECRET_ENV: issued_secret(deployment.keys_dir, spec.name)} if deployment.keys_dir else {}
        node = Node(place["node"], place["address"])
        launches.append(ProcessLaunch(spec, node, command, {**env, **own, **gpu_environment(place)}, log_path))
    return launches


def gpu_environment(place: dict[str, Any]) -> dict[str, str]:
    """The environment that gives a process the GPUs of its place (deployment.json's): CUDA_VISIBLE_DEVICES for
    one the local engine gave GPUs of its own (SLURM and Ray set theirs), and the memory share a trainer or hf
    server on a shared GPU keeps to (`GPU_SHARE_ENV`, read by `mas_async.devices.use_device`; a vLLM server takes its own from the
    config as gpu_memory_utilization)."""
    env = {}
    if place.get("cuda_visible_devices"):
        env["CUDA_VISIBLE_DEVICES"] = place["cuda_visible_devices"]
    if place.get("share") is not None and str(place.get("device", "")).startswith("cuda"):
        env[GPU_SHARE_ENV] = repr(float(place["share"]))
    return env


def start_children(
    config: Config,
    run_dir: Path,
    training: bool = True,
    *,
    roles: str = DEFAULT_ROLES,
    options: dict[str, Any] | None = None,
    engine: Engine,
) -> list[Child]:
    """Start every process of the deployment with `engine` (`process_launches`). The caller stops them
    (`stop_children`), then closes the engine."""
    launches = process_launches(config, run_dir, training, roles=roles, options=options)
    children = [launch.start(engine) for launch in launches]
    write_pids(run_dir, children)
    return children


def write_pids(run_dir: Path, children: list[Child]) -> None:
    """RUN_DIR/pids.json: name -> pid on its node (deployment.json says which node), what a test or an
    operator kills by pid; rewritten when a lost process is replaced, atomically (temp name, then rename),
    so a reader never sees it half-written."""
    tmp = run_dir / "pids.json.tmp"
    tmp.write_text(json.dumps({c.name: c.pid for c in children}, indent=2))
    os.replace(tmp, run_dir / "pids.json")


def stop_children(children: list[Child], grace_s: float = 5.0) -> None:
    """SIGTERM every child (and what it started), then SIGKILL whatever is left after `grace_s`."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        child.wait(max(0.0, deadline - time.monotonic()))
    for child in children:
        child.kill()
        if child.poll() is None:
            child.wait(5)


class RunLost(Exception):
    """The run lost a process that cannot be replaced alone (a trainer, the router, a replica); it restarts
    from its last complete checkpoint."""

    def __init__(self, child: Child, status: int | None, died_at: float) -> None:
        super().__init__(f"{child.name} ({child.where()}) exited with status {status}")
        self.role = child.name.split("/")[0]
        self.died_at = died_at
        self.log_path = child.log_path
        self.tail = child.tail()


@dataclass
class Restarts:
    """What `supervise` needs to replace lost processes: the engine, how each process was started, and the
    budget left (`cluster.max_restarts` per role in the window)."""

    engine: Engine
    launches: dict[str, ProcessLaunch]
    budget: RestartBudget
    whole_run: bool
    """Whether a lost trainer, router or replica restarts the run (training runs; an evaluation just stops)."""
    config: Config
    deployment: Deployment


def supervise(children: list[Child], run_dir: Path, progress: Progress, restarts: Restarts | None = None) -> int:
    """Watch the children until the router finishes (0) or something fails (1). With `restarts`, a lost env
    worker is started again in place and a lost trainer, router or replica raises `RunLost` (after stopping
    every process), each while the role's budget lasts.

    Peers exit cleanly a moment before the router when it ends the run (it sends Shutdown first), so a
    clean exit of a peer is a failure only if the router is still running `CLEAN_EXIT_GRACE_S` later."""
    router = children[0]
    clean_exits: dict[str, float] = {}
    lost_peers = LostPeers(run_dir)
    started_at = {c.name: time.time() for c in children}
    while True:
        progress.update()
        _kill_lost(children, lost_peers, started_at, progress)
        rc = router.poll()
        if rc == 0:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(c.poll() is None for c in children):
                time.sleep(0.2)
            stop_children(children)
            progress.finish()
            progress.summary()
            return 0
        now = time.monotonic()
        lost = []
        for child in children:
            code = child.poll()
            if code is None or (code == 0 and child is router):
                continue
            if code == 0 and now - clean_exits.setdefault(child.name, now) < CLEAN_EXIT_GRACE_S:
                continue
            lost.append((child, code))
        if lost:
            # A hung peer the router named just before it stopped on its account is killed first, so that
            # it is found dead too. Found dead together: one killed by a signal is the cause, the others
            # failed on its loss (a trainer whose broadcast lost a replica, then the router that heard of
            # it), so it decides.
            for killed in _kill_lost(children, lost_peers, started_at, progress):
                code = killed.wait(KILLED_WAIT_S)
                if code is not None and all(killed is not c for c, _ in lost):
                    lost.append((killed, code))
            child, code = min(lost, key=lambda lc: lc[1] >= 0)
            role, died_at = child.name.split("/")[0], time.time()
            alone = restarts is not None and replaced_alone(restarts.config, restarts.deployment, child.name)
            if restarts is not None and alone and restarts.budget.take(role):
                record_restart(run_dir, child.name, child.pid or 0, died_at)  # the router learns of the loss now
                replacement = restarts.launches[child.name].start(restarts.engine, {DIED_AT_ENV: repr(died_at)})
                children[children.index(child)] = replacement
                started_at[child.name] = time.time()
                clean_exits.pop(child.name, None)
                write_pids(run_dir, children)
                progress.note(
                    f"{child.name} ({child.where()}) exited with status {code}; started it again as pid "
                    f"{replacement.pid} ({restarts.budget.used(role)} of {restarts.budget.max_restarts} restarts "
                    "of the role in the window)"
                )
                continue  # the others found dead, if any, are looked at again on the next turn
            progress.finish()
            stop_children(children)
            failed = code == RUN_FAILED_STATUS  # the run's own code failed: a restart would fail the same way
            if (
                restarts is not None
                and restarts.whole_run
                and role in RESTART_THE_RUN
                and not failed
                and restarts.budget.take(role)
            ):
                raise RunLost(child, code, died_at)
            why = f"exited with status {code}" if code != 0 else "exited before the run finished"
            why += "; the run is not restarted: it would fail the same way" if failed else ""
            print(f"\nmas-async: {child.name} ({child.where()}) {why}. Last lines of {child.log_path}:\n")
            print(child.tail())
            print(f"\nAll processes were stopped. Logs: {run_dir / 'logs'}", file=sys.stderr)
            return 1
        time.sleep(0.25)


def _kill_lost(
    children: list[Child], lost_peers: LostPeers, started_at: dict[str, float], progress: Progress
) -> list[Child]:
    """Kill the processes that the router declared lost and that still run (hung or stopped: they would
    never exit by themselves); a record older than the process it names is about its predecessor."""
    by_name = {c.name: c for c in children}
    killed = []
    for record in lost_peers.new():
        child = by_name.get(record["name"])
        if child is None or child.poll() is not None or started_at.get(child.name, 0.0) > record["at"]:
            continue
        progress.note(f"{child.name} ({child.where()}) was declared lost by the router ({record['why']}); killed it")
        child.kill()
        killed.append(child)
    return killed


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def check_sandbox(config: Config) -> None:
    """Refuse, before any process starts, an env that runs model-written code where this machine's
    sandbox cannot isolate it (each env worker checks again on its own node)."""
    from mas_async import sandbox
    from mas_async.api.registry import ENVS, resolve

    if not resolve(config.env.name, ENVS, "env").runs_code:
        return
    sandbox.configure(config.sandbox.unsafe_no_isolation, config.sandbox.cgroup_root)
    try:
        sandbox.require_isolation()
    except sandbox.SandboxUnavailable as error:
        raise ConfigError(f"env {config.env.name} runs model-written code, but {error}") from None


def launch(
    config: Config,
    mode: str = "train",
    roles: str = DEFAULT_ROLES,
    *,
    again: bool = False,
    stop: StopOnSignal | None = None,
) -> int:
    """Run a whole training job (mode "train") or one evaluation pass (mode "eval"); returns the exit
    status. An evaluation runs the router, inference servers and env workers, no trainers. A training run
    that loses a trainer, its router or a replica starts again from its last complete checkpoint (`RunLost`).
    `roles` is the role map the processes build their actors from (a test passes one that records).
    `again`: see `prepare_run_dir`. SIGUSR1 stops a training run at a checkpoint of its own (`stop_signal`;
    a caller that handles it already passes its `stop`); the status is then STOPPED."""
    check_loadable(config)
    check_sandbox(config)
    stop = stop or StopOnSignal()
    previous = stop.install()
    try:
        weights = None
        if mode == "eval":
            weights, start_version = eval_weights(config)
            if config.run.output_dir is None:
                config.run.name = f"{config.run.name}-eval"
            run_dir = prepare_run_dir(config)
        elif config.resume:
            config, run_dir, start_version = prepare_resume(config)
        else:
            run_dir, start_version = prepare_run_dir(config, again), 0
        stop.attach(run_dir)
        rc = _restarting(config, run_dir, start_version, mode == "train", weights, roles)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    version = latest_complete(run_dir, list(config.policies))
    if rc != 0 or mode != "train" or not stop.asked or (version is not None and version >= config.run.iterations):
        return rc
    if version is None:  # the router ended the run, but no checkpoint of every policy is there
        print(
            f"mas-async: the run stopped as asked ({stop.why}), but {run_dir} holds no complete checkpoint",
            file=sys.stderr,
        )
        return 1
    print(
        f"mas-async: stopped at the checkpoint of version {version}, as asked ({stop.why}); resume with "
        f"`mas-async train {run_dir / 'config.yaml'} resume={run_dir}`"
    )
    return STOPPED


def _restarting(
    config: Config,
    run_dir: Path,
    start_version: int,
    training: bool,
    weights: dict[str, str] | None,
    roles: str,
) -> int:
    """`_run` until the run ends, again from the last complete checkpoint after each `RunLost`."""
    engine = open_engine(config)
    budget = RestartBudget(config.cluster.max_restarts, config.cluster.restart_window_s)
    run_restarts = RunRestarts(run_dir, config.cluster.max_run_restarts)
    env: dict[str, str] = {}
    progress = Progress(config, run_dir, start_version)
    try:
        while True:
            try:
                return _run(config, run_dir, start_version, training, weights, engine, budget, env, progress, roles)
            except RunLost as lost:
                start_version = latest_complete(run_dir, list(config.policies)) or 0
                refusal = run_restarts.refusal(start_version)
                if refusal is not None:
                    print(
                        f"\nmas-async: {lost}; the run is not restarted: {refusal}. Last lines of {lost.log_path}:"
                        f"\n\n{lost.tail}\n\nAll processes were stopped. Logs: {run_dir / 'logs'}; once the cause is "
                        f"fixed, resume=RUN_DIR continues from the last complete checkpoint",
                        file=sys.stderr,
                    )
                    return 1
                run_restarts.record(lost.role, lost.died_at, start_version)
                progress.restarted(start_version)
                env = {RUN_RESTART_ENV: json.dumps({"role": lost.role, "died_at": lost.died_at})}
                print(
                    f"\nmas-async: {lost}; restarting the run from its checkpoint of version {start_version} "
                    f"({budget.used(lost.role)} of {budget.max_restarts} restarts of the role in the window, "
                    f"{len(run_restarts.records)} of {run_restarts.max_total} whole-run restarts)",
                    file=sys.stderr,
                )
    finally:
        engine.close()


def _run(
    config: Config,
    run_dir: Path,
    start_version: int,
    training: bool,
    weights: dict[str, str] | None,
    engine: Engine,
    budget: RestartBudget,
    env: dict[str, str],
    progress: Progress,
    roles: str = DEFAULT_ROLES,
) -> int:
    deployment = prepare_deployment(config, run_dir, start_version, training, weights, engine)
    launches = process_launches(config, run_dir, training, roles=roles, env=env)
    forget_restarts(run_dir)
    children = [launch.start(engine) for launch in launches]
    write_pids(run_dir, children)
    restarts = Restarts(engine, {launch.spec.name: launch for launch in launches}, budget, training, config, deployment)
    # Explicit handlers: a launcher started in the background of a script inherits SIGINT as ignored,
    # and Python then installs no KeyboardInterrupt handler; Ctrl-C and SIGTERM must always stop the run.
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return supervise(children, run_dir, progress, restarts)
    except KeyboardInterrupt:
        progress.finish()
        print("\nmas-async: interrupted; stopping every process", file=sys.stderr)
        stop_children(children)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if any(c.poll() is None for c in children):
            stop_children(children, grace_s=1.0)
