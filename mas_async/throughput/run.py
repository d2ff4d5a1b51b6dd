"""Run a rollout-only deployment to its end and read back what its actors recorded.

The processes are the launcher's (`start_children` with the role map `mas_async.throughput.actors:ROLES`,
or a benchmark's own): one log per process, own session, teardown by pid. Every wait is bounded.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mas_async.launch.engines.local import LocalEngine
from mas_async.launch.launcher import (
    Child,
    eval_weights,
    prepare_deployment,
    prepare_run_dir,
    start_children,
    stop_children,
)
from mas_async.throughput.actors import BENCH_DIR
from mas_async.wire.codec import unpack

if TYPE_CHECKING:
    from mas_async.config import Config
    from mas_async.deployment import Deployment

ROLES = "mas_async.throughput.actors:ROLES"


def prepare_rollout(config: Config) -> tuple[Path, Deployment]:
    """Write the run directory (config.run.output_dir) and the deployment of a rollout-only run: the
    config's models, or a checkpoint's weights when `eval.checkpoint` (`checkpoint=RUN_DIR`) is set."""
    weights = eval_weights(config)[0] if config.eval.checkpoint or config.eval.weights else None
    run_dir = prepare_run_dir(config)
    return run_dir, prepare_deployment(config, run_dir, training=False, weights=weights)


def start_rollout(
    config: Config, run_dir: Path, engine: LocalEngine, *, warmup: int, roles: str = ROLES
) -> list[Child]:
    """Start a rollout-only deployment (router first) through the launcher on `engine`, with the actors of
    the role map `roles`; the caller stops it with `stop_children` and then closes the engine."""
    return start_children(config, run_dir, training=False, roles=roles, options={"warmup": warmup}, engine=engine)


def run_rollout(config: Config, *, warmup: int, timeout_s: float, roles: str = ROLES) -> tuple[Path, Deployment]:
    """Run a rollout-only deployment to the end (the router finishes, the peers write their records
    as they exit); raise naming the process that failed, with its log tail, or the timeout. Every
    process is stopped by pid before this returns."""
    run_dir, deployment = prepare_rollout(config)
    engine = LocalEngine(config)
    try:
        children = start_rollout(config, run_dir, engine, warmup=warmup, roles=roles)
        try:
            wait_for_router(children, timeout_s)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(c.poll() is None for c in children):
                time.sleep(0.1)
        finally:
            stop_children(children)
    finally:
        engine.close()
    return run_dir, deployment


def wait_for_router(children: list[Child], timeout_s: float) -> None:
    """Wait until the router (the first child) exits with status 0; raise naming the process that failed,
    with its log tail, or the timeout."""
    router = children[0]
    deadline = time.monotonic() + timeout_s
    while router.poll() is None:
        failed = [c for c in children if c.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            culprit = failed[0] if failed else router
            why = f"exited with status {culprit.poll()}" if failed else f"ran past {timeout_s:.0f}s"
            raise RuntimeError(f"{culprit.name} {why}; last lines of {culprit.log_path}:\n{culprit.tail()}")
        time.sleep(0.1)
    if router.poll() != 0:
        raise RuntimeError(f"the router failed; last lines of {router.log_path}:\n{router.tail()}")


def load_record(run_dir: Path) -> dict[str, Any]:
    """Everything the actors of a finished rollout-only run wrote under RUN_DIR/bench/."""
    out = run_dir / BENCH_DIR
    requests: list[list[Any]] = []
    for path in sorted(out.glob("requests-*.msgpack")):
        requests += unpack(path.read_bytes(), max_objects=1 << 26)  # its own file: as large as the run made it
    episodes: list[list[Any]] = []
    for path in sorted(out.glob("episodes-*.json")):
        episodes += json.loads(path.read_text())
    router = json.loads((out / "phases.json").read_text())
    return {
        "phases": router["phases"],
        "malformed": router["malformed"],
        "requests": requests,
        "episodes": episodes,
        "batches": {
            p.stem.removeprefix("batches-"): json.loads(p.read_text()) for p in sorted(out.glob("batches-*.json"))
        },
        "processes": {
            p.stem.removeprefix("process-"): json.loads(p.read_text()) for p in sorted(out.glob("process-*.json"))
        },
    }
