"""The actors of a rollout-only deployment, which `mas-async bench` measures.

A rollout-only deployment is the real router, env workers and inference servers, without trainers (a
deployment with `training = False`, as for `mas-async eval`): the router runs `warmup + iterations`
rollout phases of training episodes (tree sampling, groups recorded) back to back, counts and drops
the groups (there is no trainer to take them) and never steps or syncs weights. Three thin subclasses
add only what the benchmark reads afterwards, each written to RUN_DIR/bench/ when its process ends
(nothing is decoded or written on the hot path):

- `RolloutRouter`: the wall-clock window, episodes, turns and tokens of every phase, an OpenAI API program's
  calls (`gateway/*` sums), and the messages it routed with the CPU it spent (phases.json);
- `RecordingEnvWorker`: every generate request (episode, policy, prompt ids, n, send and reply times,
  tokens), so the baseline can replay exactly the same prompts, and each episode's wall time and the
  part of it spent waiting for generation (requests-<worker>.msgpack, episodes-<worker>.json);
- `TimedInferenceServer`: the window and size of every batch it generated (batches-<replica>.json).

Every one of them also writes its process's CPU seconds and peak RSS (process-<name>.json). `ROLES` is
the role map the launcher starts them from (`mas_async.throughput.run`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mas_async.inference.server import InferenceServer
from mas_async.launch.roles import seed_torch
from mas_async.metrics import Keys
from mas_async.rollout.env_worker import EnvWorker
from mas_async.router.hub import Router
from mas_async.runtime.actor import PeerDead
from mas_async.startup import startup_bound_reason, startup_bound_s
from mas_async.wire.codec import pack
from mas_async.wire.messages import Shutdown

if TYPE_CHECKING:
    import numpy as np

    from mas_async.config import Config
    from mas_async.deployment import Deployment
    from mas_async.wire.samples import Completion

log = logging.getLogger("mas_async.throughput")

BENCH_DIR = "bench"
"""Sub-folder of the run directory where the bench actors write what they measured."""


current_episode: ContextVar[str] = ContextVar("current_episode", default="")
"""The episode whose work runs now (the parallel workflow's requests run in tasks of their own)."""


def write_process_stats(run_dir: Path, name: str) -> None:
    """This process's CPU seconds (user + system; its threads included, so it may exceed its wall
    time), peak RSS and wall time since it started, for the report."""
    import psutil

    usage = resource.getrusage(resource.RUSAGE_SELF)
    stats = {
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "max_rss_mb": usage.ru_maxrss / 1024,  # kilobytes on Linux
        "wall_s": time.time() - psutil.Process().create_time(),
    }
    (bench_dir(run_dir) / f"process-{name.replace('/', '-')}.json").write_text(json.dumps(stats))


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
        self.messages = 0

    def _on_frames(self, frames: list) -> None:
        self.messages += 1
        super()._on_frames(frames)

    def _hold_groups(self, worker: bytes, header: Any, frames: list) -> None:
        self.dropped_groups += 1  # no trainer in a rollout-only deployment

    async def main(self) -> None:
        bound_s = startup_bound_s(self.cfg)  # (as the router's: a vLLM server says Hello once its engine started)
        try:
            await asyncio.wait_for(self.all_joined.wait(), bound_s)
        except TimeoutError:
            missing = self.table.missing()
            raise PeerDead(
                f"peers never joined within {bound_s:g}s: {missing} (the bound: {startup_bound_reason(self.cfg)})"
            ) from None
        for iteration in range(self.warmup + self.cfg.run.iterations):
            start, messages, cpu = time.time(), self.messages, time.process_time()
            book = await self.rollout(iteration, train=True, evaluate=False)
            del self.books[iteration]
            stats = book.stats["train"]
            phase = {
                "iteration": iteration,
                "warmup": iteration < self.warmup,
                "start": start,
                "end": time.time(),
                "router_messages": self.messages - messages,
                "router_cpu_s": time.process_time() - cpu,
                "episodes": stats.episodes,
                "dropped": book.dropped["train"],
                "tokens": stats.tokens,
                "turns": stats.sums.get("turns", 0.0),
                # An OpenAI API program's calls per agent, in all and answered in-process (sums over the episodes).
                "gateway": {key: value for key, value in stats.sums.items() if key.startswith(Keys.GATEWAY_PREFIX)},
            }
            self.phases.append(phase)
            log.info("rollout phase %d: %.3fs, %d tokens", iteration, phase["end"] - start, stats.tokens)
        for ident in self.peers:
            self.send_to(ident, Shutdown("rollout benchmark finished", False))
        await asyncio.sleep(0.5)  # let the send loop flush the Shutdown messages

    async def cleanup(self) -> None:
        summary = {"phases": self.phases, "dropped_groups": self.dropped_groups, "malformed": self.malformed}
        (bench_dir(self.run_dir) / "phases.json").write_text(json.dumps(summary, indent=1))
        write_process_stats(self.run_dir, self.peer_id)
        await super().cleanup()


class RecordingEnvWorker(EnvWorker):
    """An env worker that records every generate request it made (and how long the reply took)."""

    def __init__(self, config: Config, deployment: Deployment, index: int, run_dir: Path) -> None:
        super().__init__(config, deployment, index)
        self.run_dir = run_dir
        self.requests: list[list[Any]] = []
        self.episodes: list[list[Any]] = []
        """[episode id, seconds from RunEpisode to EpisodeDone, seconds of it waiting for generation]."""
        self._waiting: dict[str, list[tuple[float, float]]] = {}
        """episode -> (sent, replied) of each of its requests."""

    async def generate(
        self, policy: str, prompt_ids: np.ndarray, n: int, greedy: bool, **sampling: Any
    ) -> list[Completion]:
        sent = time.time()  # (`sampling`: a gateway call's max_tokens and temperature, as EnvWorker.generate takes)
        completions = await super().generate(policy, prompt_ids, n, greedy, **sampling)
        replied = time.time()
        episode = current_episode.get()  # set by _run_episode; inherited by the tasks an episode starts
        tokens = sum(len(c.token_ids) for c in completions)
        self.requests.append([episode, policy, prompt_ids, n, greedy, sent, replied, tokens])
        self._waiting.setdefault(episode, []).append((sent, replied))
        return completions

    async def _run_episode(self, msg: Any) -> None:
        start = time.time()
        current_episode.set(msg.episode_id)
        await super()._run_episode(msg)
        # The union of the episode's request windows: agents acting at once wait together, not twice.
        waiting, reach = 0.0, 0.0
        for sent, replied in sorted(self._waiting.pop(msg.episode_id, [])):
            waiting += max(0.0, replied - max(sent, reach))
            reach = max(reach, replied)
        self.episodes.append([msg.episode_id, time.time() - start, waiting])

    async def cleanup(self) -> None:
        name = self.peer_id.replace("/", "-")
        (bench_dir(self.run_dir) / f"requests-{name}.msgpack").write_bytes(pack(self.requests))
        (bench_dir(self.run_dir) / f"episodes-{name}.json").write_text(json.dumps(self.episodes))
        write_process_stats(self.run_dir, self.peer_id)


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
        write_process_stats(self.run_dir, self.peer_id)


# -- roles -----------------------------------------------------------------------------------------


def _router(config: Config, deployment: Deployment, run_dir: Path, *, index: int, policy: str, warmup: int) -> Any:
    return RolloutRouter(config, deployment, run_dir, warmup)


def _env_worker(config: Config, deployment: Deployment, run_dir: Path, *, index: int, policy: str, warmup: int) -> Any:
    return RecordingEnvWorker(config, deployment, index, run_dir)


def _inference(config: Config, deployment: Deployment, run_dir: Path, *, index: int, policy: str, warmup: int) -> Any:
    seed_torch(config)
    return TimedInferenceServer(config, deployment, policy, index, run_dir)


ROLES = {"router": _router, "env_worker": _env_worker, "inference": _inference}
"""The rollout-only deployment's roles (no trainers), for `mas_async.launch.launcher.start_children`."""
