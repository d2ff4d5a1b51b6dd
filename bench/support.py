"""Rollout-only deployments for the throughput benchmark (`bench/rollout_throughput.py`).

A rollout-only deployment is the real router, env workers and inference servers, without trainers (a
deployment with `training = False`, as for `mas-async eval`): the router runs `warmup + iterations`
rollout phases of training episodes (tree sampling, groups recorded) back to back, counts and drops
the groups (there is no trainer to take them) and never steps or syncs weights. Three thin subclasses
add only what the benchmark reads afterwards, each written to RUN_DIR/bench/ when its process ends
(nothing is decoded or written on the hot path):

- `RolloutRouter`: the wall-clock window, episodes, turns and tokens of every phase (phases.json);
- `RecordingEnvWorker`: every generate request (episode, prompt ids, n, send and reply times), so the
  standalone baseline can replay exactly the same prompts (requests-<worker>.msgpack);
- `TimedInferenceServer`: the window and size of every batch it generated (batches-<replica>.json).

`start_rollout(config, run_dir)` starts the processes through the launcher (`start_children` with this
module's role map `ROLLOUT_ROLES`): one log per process, own session, teardown by pid.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mas_async.inference.server import InferenceServer
from mas_async.launch.launcher import Child, start_children, stop_children
from mas_async.launch.roles import seed_torch
from mas_async.rollout.env_worker import EnvWorker
from mas_async.router.hub import Router
from mas_async.runtime.actor import PeerDead
from mas_async.wire.codec import pack
from mas_async.wire.messages import Shutdown

if TYPE_CHECKING:
    import numpy as np

    from mas_async.config import Config
    from mas_async.deployment import Deployment
    from mas_async.wire.samples import Completion

log = logging.getLogger("mas_async.bench")

BENCH_DIR = "bench"
"""Sub-folder of the run directory where the bench actors write what they measured."""


def bench_dir(run_dir: Path) -> Path:
    path = run_dir / BENCH_DIR
    path.mkdir(parents=True, exist_ok=True)
    return path


class RolloutRouter(Router):
    """The router without trainers: `warmup + iterations` rollout phases, no training step."""

    def __init__(self, config: Config, deployment: Deployment, run_dir: Path, warmup: int) -> None:
        super().__init__(config, deployment, run_dir)
        self.warmup = warmup
        self.phases: list[dict[str, Any]] = []
        self.dropped_groups = 0

    def _hold_groups(self, header: Any, frames: list) -> None:
        self.dropped_groups += 1  # no trainer in a rollout-only deployment

    async def main(self) -> None:
        try:
            await asyncio.wait_for(self.all_joined.wait(), self.cfg.cluster.startup_timeout_s)
        except TimeoutError:
            missing = self.table.missing()
            raise PeerDead(f"peers never joined within {self.cfg.cluster.startup_timeout_s}s: {missing}") from None
        for iteration in range(self.warmup + self.cfg.run.iterations):
            start = time.time()
            book = await self.rollout(iteration, train=True, evaluate=False)
            stats = book.stats["train"]
            phase = {
                "iteration": iteration,
                "warmup": iteration < self.warmup,
                "start": start,
                "end": time.time(),
                "episodes": stats.episodes,
                "dropped": book.dropped["train"],
                "tokens": stats.tokens,
                "turns": stats.sums.get("turns", 0.0),
            }
            self.phases.append(phase)
            log.info("rollout phase %d: %.3fs, %d tokens", iteration, phase["end"] - start, stats.tokens)
        for ident in self.peers:
            self.send_to(ident, Shutdown("rollout benchmark finished", False))
        await asyncio.sleep(0.5)  # let the send loop flush the Shutdown messages

    async def cleanup(self) -> None:
        summary = {"phases": self.phases, "dropped_groups": self.dropped_groups, "malformed": self.malformed}
        (bench_dir(self.run_dir) / "phases.json").write_text(json.dumps(summary, indent=1))
        await super().cleanup()


class RecordingEnvWorker(EnvWorker):
    """An env worker that records every generate request it made (and how long the reply took)."""

    def __init__(self, config: Config, deployment: Deployment, index: int, run_dir: Path) -> None:
        super().__init__(config, deployment, index)
        self.run_dir = run_dir
        self.requests: list[list[Any]] = []

    async def generate(self, policy: str, prompt_ids: np.ndarray, n: int, greedy: bool) -> list[Completion]:
        sent = time.time()
        completions = await super().generate(policy, prompt_ids, n, greedy)
        task = asyncio.current_task()  # each episode runs as a task named by its episode id
        episode = task.get_name() if task is not None else ""
        tokens = sum(len(c.token_ids) for c in completions)
        self.requests.append([episode, policy, prompt_ids, n, greedy, sent, time.time(), tokens])
        return completions

    async def cleanup(self) -> None:
        name = self.peer_id.replace("/", "-")
        (bench_dir(self.run_dir) / f"requests-{name}.msgpack").write_bytes(pack(self.requests))


class _TimedBackend:
    """Wraps a backend and records (start, end, sequences) of every generate call."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.batches: list[tuple[float, float, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    async def generate(self, requests: list) -> list:
        start = time.time()
        results = await self.backend.generate(requests)
        self.batches.append((start, time.time(), sum(r.n for r in requests)))
        return results


class TimedInferenceServer(InferenceServer):
    """An inference server that times its batches (its deployment has no trainer, so no weight group)."""

    def __init__(self, config: Config, deployment: Deployment, policy: str, replica: int, run_dir: Path) -> None:
        super().__init__(config, deployment, policy, replica)
        self.run_dir = run_dir
        self.timed = _TimedBackend(self.backend)
        self.backend = self.timed

    async def cleanup(self) -> None:
        name = self.peer_id.replace("/", "-")
        (bench_dir(self.run_dir) / f"batches-{name}.json").write_text(json.dumps(self.timed.batches))


# -- processes -----------------------------------------------------------------------------------


def prepare_rollout(config: Config) -> tuple[Path, Deployment]:
    """Write the run directory (config.run.output_dir) and the deployment of a rollout-only run."""
    from mas_async.launch.launcher import prepare_deployment, prepare_run_dir

    run_dir = prepare_run_dir(config)
    return run_dir, prepare_deployment(config, run_dir, training=False)


def start_rollout(
    config: Config, run_dir: Path, *, warmup: int, roles: str = "bench.support:ROLLOUT_ROLES"
) -> list[Child]:
    """Start a rollout-only deployment (router first) through the launcher, with the actors of the
    role map `roles`; the caller stops it with `stop_children`."""
    return start_children(config, run_dir, training=False, roles=roles, options={"warmup": warmup})


def run_rollout(
    config: Config, *, warmup: int, timeout_s: float, roles: str = "bench.support:ROLLOUT_ROLES"
) -> tuple[Path, Deployment]:
    """Run a rollout-only deployment to the end (the router finishes, the peers write their records
    as they exit); raise naming the process that failed, with its log tail, or the timeout. Every
    process is stopped by pid before this returns."""
    run_dir, deployment = prepare_rollout(config)
    children = start_rollout(config, run_dir, warmup=warmup, roles=roles)
    router = children[0]
    try:
        deadline = time.monotonic() + timeout_s
        while router.proc.poll() is None:
            failed = [c for c in children if c.proc.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                culprit = failed[0] if failed else router
                why = f"exited with status {culprit.proc.returncode}" if failed else f"ran past {timeout_s:.0f}s"
                raise RuntimeError(f"{culprit.name} {why}; last lines of {culprit.log_path}:\n{culprit.tail()}")
            time.sleep(0.1)
        if router.proc.returncode != 0:
            raise RuntimeError(f"the router failed; last lines of {router.log_path}:\n{router.tail()}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(c.proc.poll() is None for c in children):
            time.sleep(0.1)
    finally:
        stop_children(children)
    return run_dir, deployment


def _router(config: Config, deployment: Deployment, run_dir: Path, *, index: int, policy: str, warmup: int) -> Any:
    return RolloutRouter(config, deployment, run_dir, warmup)


def _env_worker(config: Config, deployment: Deployment, run_dir: Path, *, index: int, policy: str, warmup: int) -> Any:
    return RecordingEnvWorker(config, deployment, index, run_dir)


def _inference(config: Config, deployment: Deployment, run_dir: Path, *, index: int, policy: str, warmup: int) -> Any:
    seed_torch(config)
    return TimedInferenceServer(config, deployment, policy, index, run_dir)


ROLLOUT_ROLES = {"router": _router, "env_worker": _env_worker, "inference": _inference}
"""The rollout-only deployment's roles (no trainers), for `mas_async.launch.launcher.start_children`."""
