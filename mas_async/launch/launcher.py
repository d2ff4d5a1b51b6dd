"""The launcher: starts every process of a run on this machine, watches them, and tears them down.

`launch(config)` prepares the run directory (resolved config, deployment.json with endpoints and model
folders, one log file per process), materialises built-in models once, then starts the router,
`trainer_ranks` trainer processes and `replicas` inference servers per policy, and `cluster.env_workers` env workers, each as
`python -m mas_async.launch.process ROLE ...` in its own session (the actor comes from a role -> factory
map, `mas_async.launch.roles.ROLES`; benchmarks start their own actors through the same function). It shows live progress from metrics.jsonl. If any
process fails (or exits before the router finished the run), every other process is stopped and the
failed role is named with the tail of its log; the exit status is non-zero. Ctrl-C (or SIGTERM) stops
everything within seconds: SIGTERM to each child's process group by pid, SIGKILL after a grace period.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from mas_async.checkpoint import complete_versions, latest_complete, load_best, policy_checkpoint
from mas_async.config import Config, ConfigError, dump_config, load_config
from mas_async.deployment import Deployment, free_ports, trainer_peer
from mas_async.launch.progress import Progress
from mas_async.launch.roles import DEFAULT_ROLES
from mas_async.runtime.curve import prepare_keys

CLEAN_EXIT_GRACE_S = 10.0


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def model_cache_dir() -> Path:
    return Path(os.environ.get("MAS_ASYNC_CACHE", Path.home() / ".cache" / "mas-async")) / "models"


def prepare_run_dir(config: Config) -> Path:
    if config.run.output_dir is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        config.run.output_dir = f"runs/{config.run.name}/{stamp}"
    run_dir = config.output_dir()
    if (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"run directory {run_dir} already holds a run; choose another run.output_dir")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    dump_config(config, run_dir / "config.yaml")
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
    config: Config, run_dir: Path, start_version: int = 0, training: bool = True, weights: dict[str, str] | None = None
) -> Deployment:
    from mas_async.model_source import resolve_model

    keys_dir = prepare_keys(config, run_dir)
    host = config.cluster.host
    policies = list(config.policies)
    ports = free_ports(host, 1 + 2 * len(policies))
    paths = {name: str(resolve_model(spec.model, model_cache_dir())) for name, spec in config.policies.items()}
    deployment = Deployment(
        router_endpoint=f"tcp://{host}:{ports[0]}",
        weight_ports=dict(zip(policies, ports[1 : 1 + len(policies)], strict=True)),
        trainer_ports=dict(zip(policies, ports[1 + len(policies) :], strict=True)),
        model_paths=paths,
        host=host,
        start_version=start_version,
        weights_paths={p: str(policy_checkpoint(run_dir, p, start_version)) for p in paths} if start_version else {},
        training=training,
        keys_dir=keys_dir,
    )
    if weights is not None:
        deployment.weights_paths = weights
    deployment.save(run_dir / "deployment.json")
    return deployment


def process_specs(config: Config, training: bool = True) -> list[tuple[str, list[str]]]:
    """(name, arguments after the run dir) for every process, router first."""
    specs: list[tuple[str, list[str]]] = [("router", ["router"])]
    for policy, spec in config.policies.items():
        if training:
            for rank in range(spec.trainer_ranks):
                specs.append((trainer_peer(policy, rank), ["trainer", "--policy", policy, "--index", str(rank)]))
        for r in range(spec.replicas):
            specs.append((f"inference/{policy}/{r}", ["inference", "--policy", policy, "--index", str(r)]))
    for i in range(config.cluster.env_workers):
        specs.append((f"env_worker/{i}", ["env_worker", "--index", str(i)]))
    return specs


def start_children(
    config: Config,
    run_dir: Path,
    training: bool = True,
    *,
    roles: str = DEFAULT_ROLES,
    options: dict[str, Any] | None = None,
) -> list[Child]:
    """Start every process of the deployment, router first, each as `python -m mas_async.launch.process`
    building its actor from the role map `roles` ("module:ATTR"; a benchmark passes its own) with the
    keyword `options`; one log per process, each in its own session (torn down by pid)."""
    children = []
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(config.cluster.torch_threads))
    extra = ["--roles", roles, "--options", json.dumps(options or {})]
    for name, args in process_specs(config, training):
        log_path = run_dir / "logs" / f"{name.replace('/', '-')}.log"
        with log_path.open("ab") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "mas_async.launch.process", args[0], str(run_dir), *args[1:], *extra],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        children.append(Child(name, proc, log_path))
    (run_dir / "pids.json").write_text(json.dumps({c.name: c.proc.pid for c in children}, indent=2))
    return children


def stop_children(children: list[Child], grace_s: float = 5.0) -> None:
    """SIGTERM every child's process group, then SIGKILL whatever is left after `grace_s`."""
    for child in children:
        if child.proc.poll() is None:
            _signal_group(child.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for child in children:
        # The group may hold grandchildren (sandboxes) even after the child itself exited.
        _signal_group(child.proc.pid, signal.SIGKILL)
        if child.proc.poll() is None:
            child.proc.wait(timeout=5)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def supervise(children: list[Child], run_dir: Path, progress: Progress) -> int:
    """Watch the children until the router finishes (0) or something fails (1).

    Peers exit cleanly a moment before the router when it ends the run (it sends Shutdown first), so a
    clean exit of a peer is a failure only if the router is still running `CLEAN_EXIT_GRACE_S` later."""
    router = children[0]
    clean_exits: dict[str, float] = {}
    while True:
        progress.update()
        rc = router.proc.poll()
        if rc == 0:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(c.proc.poll() is None for c in children):
                time.sleep(0.2)
            stop_children(children)
            progress.finish()
            return 0
        now = time.monotonic()
        for child in children:
            code = child.proc.poll()
            if code is None or (code == 0 and child is router):
                continue
            if code == 0 and now - clean_exits.setdefault(child.name, now) < CLEAN_EXIT_GRACE_S:
                continue
            progress.finish()
            stop_children(children)
            why = f"exited with status {code}" if code != 0 else "exited before the run finished"
            print(f"\nmas-async: {child.name} (pid {child.proc.pid}) {why}. Last lines of {child.log_path}:\n")
            print(child.tail())
            print(f"\nAll processes were stopped. Logs: {run_dir / 'logs'}", file=sys.stderr)
            return 1
        time.sleep(0.25)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def launch(config: Config, mode: str = "train") -> int:
    """Run a whole training job (mode "train") or one evaluation pass (mode "eval"); returns the exit
    status. An evaluation runs the router, inference servers and env workers, no trainers."""
    weights = None
    if mode == "eval":
        weights, start_version = eval_weights(config)
        if config.run.output_dir is None:
            config.run.name = f"{config.run.name}-eval"
        run_dir = prepare_run_dir(config)
    elif config.resume:
        config, run_dir, start_version = prepare_resume(config)
    else:
        run_dir, start_version = prepare_run_dir(config), 0
    training = mode == "train"
    prepare_deployment(config, run_dir, start_version, training, weights)
    progress = Progress(config, run_dir)
    children = start_children(config, run_dir, training)
    # Explicit handlers: a launcher started in the background of a script inherits SIGINT as ignored,
    # and Python then installs no KeyboardInterrupt handler; Ctrl-C and SIGTERM must always stop the run.
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return supervise(children, run_dir, progress)
    except KeyboardInterrupt:
        progress.finish()
        print("\nmas-async: interrupted; stopping every process", file=sys.stderr)
        stop_children(children)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if any(c.proc.poll() is None for c in children):
            stop_children(children, grace_s=1.0)
