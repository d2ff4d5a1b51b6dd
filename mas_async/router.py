"""The router: the hub of the deployment and the version clock (DESIGN.md sections 3 and 4).

It owns the task queue (the dataset's problems), dispatches episodes to env workers (bounded
concurrency per worker), forwards each Generate to the replica of its policy with the fewest outstanding
sequences and each result back to its origin, routes finished groups to the trainer of their policy, and
runs the strict on-policy iteration barrier:

1. dispatch the iteration's episodes at version v (and, every few iterations, the held-out eval episodes);
2. forward each episode's groups to the trainers as they arrive; no weights change meanwhile;
3. when every episode is in (or timed out and counted as dropped), send TrainStep(v) to every trainer;
   trainers step in parallel and broadcast weights v+1; each inference server acknowledges
   WeightsLoaded(v+1); only then does iteration v+1 start.

On the hot path (Generate, GenerateResult, Groups) only the kind byte and the small header frame are
decoded; payload frames are forwarded untouched. The router writes RUN_DIR/metrics.jsonl.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from envs import ENVS
from mas_async.checkpoint import checkpoint_due, save_router
from mas_async.codec import CodecError
from mas_async.config import Config
from mas_async.deployment import Deployment
from mas_async.messages import (
    PROTOCOL_VERSION,
    EpisodeDone,
    Generate,
    GenerateResult,
    Groups,
    Heartbeat,
    Hello,
    Message,
    RunEpisode,
    Shutdown,
    Trained,
    TrainStep,
    UpdateWeights,
    WeightsLoaded,
    Welcome,
    decode,
    encode,
    peek,
)
from mas_async.metrics import EpisodeStats, MetricsWriter, keep_rows_before
from mas_async.registry import resolve
from mas_async.router_socket import RouterSocket
from mas_async.runtime import Actor, PeerDead, make_socket

log = logging.getLogger("mas_async.router")


@dataclass
class PeerInfo:
    role: str
    policy: str
    capacity: int
    pid: int
    last_seen: float = field(default_factory=time.monotonic)
    outstanding: int = 0
    """Inference: sequences in flight. Env worker: episodes in flight."""
    alive: bool = True


@dataclass
class EpisodeTask:
    msg: RunEpisode
    worker: bytes | None = None
    deadline: float = 0.0


class IterationState:
    """Book-keeping of one iteration: which episodes are out, what came back, what trainers said."""

    def __init__(self, iteration: int, version: int, policies: list[str]) -> None:
        self.iteration = iteration
        self.version = version
        self.in_flight: dict[str, EpisodeTask] = {}
        self.queued: list[EpisodeTask] = []
        self.stats = {"train": EpisodeStats(), "eval": EpisodeStats()}
        self.dropped = {"train": 0, "eval": 0}
        self.eval_solved: dict[str, list[bool]] = {}
        """test problem -> success of each of its eval.k episodes (for pass@k)."""
        self.first_error = ""
        self.forwarded: dict[str, int] = defaultdict(int)
        self.late_groups = 0
        self.rollout_done = asyncio.Event()
        self.trained: dict[str, dict[str, Any]] = {}
        self.loaded: set[str] = set()
        self.step_done = asyncio.Event()
        self.policies = policies


class Router(Actor):
    role = "router"

    def __init__(self, config: Config, deployment: Deployment, run_dir: Path) -> None:
        super().__init__("router")
        self.cfg = config
        self.deployment = deployment
        self.run_dir = run_dir
        self.policies = list(config.policies)
        self.peers: dict[bytes, PeerInfo] = {}
        self.deployment = deployment
        self.expected = self._expected_peers()
        self.all_joined = asyncio.Event()
        self._pending: dict[tuple[bytes, int], bytes] = {}
        """(origin, request id) -> the inference replica serving it."""
        self._replicas: dict[str, list[tuple[bytes, PeerInfo]]] = {}
        """policy -> its live inference replicas (kept on join and death)."""
        self.state: IterationState | None = None
        env_cls = resolve(config.env.name, ENVS, "env")
        self.train_problems = env_cls.problems("train", config.env.train_size, **config.env.options)
        self.test_problems = env_cls.problems("test", config.env.test_size, **config.env.options)
        self._order = list(range(len(self.train_problems)))
        random.Random(config.run.seed).shuffle(self._order)
        self.start = deployment.start_version
        if self.start:
            keep_rows_before(run_dir / "metrics.jsonl", self.start)
        self.metrics = MetricsWriter(run_dir / "metrics.jsonl")
        self.started = time.monotonic()

    def _expected_peers(self) -> set[str]:
        names = {f"env_worker/{i}" for i in range(self.cfg.cluster.env_workers)}
        for policy, spec in self.cfg.policies.items():
            names |= {f"inference/{policy}/{r}" for r in range(spec.replicas)}
            if self.deployment.training:
                names.add(f"trainer/{policy}")
        return names

    # -- sockets -----------------------------------------------------------------------------------

    async def setup(self) -> None:
        """Socket: ROUTER bound at the deployment's endpoint, driven by `RouterSocket` (plain pyzmq
        calls woken by the event loop). ROUTER_MANDATORY makes a send to an unknown or vanished
        identity an error (logged) instead of a silent drop; at the high-water mark sends wait in an
        outbox rather than drop."""
        assert self.ctx is not None
        sock = make_socket(self.ctx, zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.bind(self.deployment.router_endpoint)
        self.io = RouterSocket(zmq.Socket.shadow(sock.underlying), self._on_frames)
        self._sock = sock  # owns the socket (closed with the context)
        self.spawn(self.io.run(), "receive")
        self.spawn(self._watchdog(), "watchdog")
        log.info("router bound at %s; waiting for %d peers", self.deployment.router_endpoint, len(self.expected))

    def send_to(self, identity: bytes, msg: Message) -> None:
        self.io.send([identity, *encode(msg)])

    def forward(self, identity: bytes, frames: list) -> None:
        self.io.send([identity, *frames])

    def _on_frames(self, frames: list) -> None:
        identity, body = frames[0].bytes, frames[1:]
        try:
            cls, header = peek([f.buffer for f in body])
            if cls is Generate:
                self._route_generate(identity, header, body)
            elif cls is GenerateResult:
                self._route_result(identity, header, body)
            elif cls is Groups:
                self._route_groups(header, body)
            else:
                # Liveness: every peer sends a Heartbeat each heartbeat_s, busy or not, so the hot path
                # above need not stamp its messages.
                peer = self.peers.get(identity)
                if peer is not None:
                    peer.last_seen = time.monotonic()
                if cls is not Heartbeat:
                    self._handle(identity, decode([f.buffer for f in body]))
        except CodecError as e:
            self.malformed += 1
            log.warning("dropped a malformed message from %r (%d so far): %s", identity, self.malformed, e)

    # -- hot path: header-only forwarding ----------------------------------------------------------

    def _route_generate(self, origin: bytes, header: list, frames: list) -> None:
        request_id, policy = header[0], header[1]
        replicas = self._replicas.get(policy)
        if not replicas:
            reply = GenerateResult(request_id, origin.decode(), f"no inference server for policy {policy!r}", [])
            self.send_to(origin, reply)
            return
        # The live replica with the fewest outstanding requests (the header does not carry n: requests
        # are counted, close enough for balancing).
        server, info = replicas[0]
        for candidate in replicas:
            if candidate[1].outstanding < info.outstanding:
                server, info = candidate
        info.outstanding += 1
        self._pending[(origin, request_id)] = server
        self.forward(server, frames)

    def _route_result(self, server: bytes, header: list, frames: list) -> None:
        request_id, origin = header[0], header[1].encode()
        if self._pending.pop((origin, request_id), None) is not None and server in self.peers:
            self.peers[server].outstanding -= 1
        self.forward(origin, frames)

    def _route_groups(self, header: list, frames: list) -> None:
        policy, iteration, episode_id, n_samples = header
        state = self.state
        if state is None or iteration != state.iteration or episode_id not in state.in_flight:
            # The episode timed out (counted as dropped) or belongs to an old iteration: its samples
            # were generated by weights that are gone, so they never reach a trainer.
            if state is not None:
                state.late_groups += 1
            log.warning("dropped late groups of episode %s (iteration %s)", episode_id, iteration)
            return
        state.forwarded[policy] += n_samples
        self.forward(f"trainer/{policy}".encode(), frames)

    # -- control messages --------------------------------------------------------------------------

    def _handle(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, Hello):
            self._on_hello(identity, msg)
        elif isinstance(msg, EpisodeDone):
            self._on_episode_done(msg)
        elif isinstance(msg, UpdateWeights):
            for ident, info in self.peers.items():
                if info.role == "inference" and info.policy == msg.policy:
                    self.send_to(ident, msg)
        elif isinstance(msg, Trained):
            self._on_trained(msg)
        elif isinstance(msg, WeightsLoaded):
            self._on_loaded(msg)
        else:
            self.malformed += 1
            log.warning("unexpected %s from %r", type(msg).__name__, identity)

    def _on_hello(self, identity: bytes, msg: Hello) -> None:
        name = identity.decode()
        if msg.protocol != PROTOCOL_VERSION:
            raise RuntimeError(f"{name} speaks protocol {msg.protocol}, the router {PROTOCOL_VERSION}")
        if name not in self.expected:
            log.warning("ignoring Hello from unexpected peer %s", name)
            return
        info = self.peers[identity] = PeerInfo(msg.role, msg.policy, msg.capacity, msg.pid)
        if msg.role == "inference":  # a repeated Hello replaces the replica's entry
            replicas = [r for r in self._replicas.get(msg.policy, []) if r[0] != identity]
            self._replicas[msg.policy] = [*replicas, (identity, info)]
        self.send_to(identity, Welcome(PROTOCOL_VERSION))
        log.info("%s joined (pid %d); %d/%d peers", name, msg.pid, len(self.peers), len(self.expected))
        if {p.decode() for p in self.peers} == self.expected:
            self.all_joined.set()

    def _on_episode_done(self, msg: EpisodeDone) -> None:
        state = self.state
        if state is None or msg.iteration != state.iteration or msg.episode_id not in state.in_flight:
            return
        task = state.in_flight.pop(msg.episode_id)
        if task.worker in self.peers:
            self.peers[task.worker].outstanding -= 1
        if msg.error:
            state.dropped[msg.mode] += 1
            state.first_error = state.first_error or msg.error
            log.error("episode %s failed: %s", msg.episode_id, msg.error)
        else:
            state.stats[msg.mode].add(msg.summary)
            if msg.mode == "eval":
                state.eval_solved.setdefault(task.msg.problem_id, []).append(bool(msg.summary.get("success")))
        self._dispatch()

    def _on_trained(self, msg: Trained) -> None:
        state = self.state
        if msg.error:
            raise RuntimeError(f"trainer of policy {msg.policy!r} failed: {msg.error}")
        if state is None or msg.version != state.version + 1:
            raise RuntimeError(
                f"trainer of {msg.policy!r} reports version {msg.version}, expected {state and state.version + 1}"
            )
        state.trained[msg.policy] = msg.metrics
        self._check_step_done()

    def _on_loaded(self, msg: WeightsLoaded) -> None:
        state = self.state
        if msg.error:
            raise RuntimeError(f"{msg.replica} failed to load weights v{msg.version}: {msg.error}")
        if state is None or msg.version != state.version + 1:
            raise RuntimeError(f"{msg.replica} loaded version {msg.version}, expected {state and state.version + 1}")
        state.loaded.add(msg.replica)
        self._check_step_done()

    def _check_step_done(self) -> None:
        state = self.state
        replicas = sum(spec.replicas for spec in self.cfg.policies.values())
        if state and len(state.trained) == len(self.policies) and len(state.loaded) == replicas:
            state.step_done.set()

    # -- episodes ----------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Hand queued episodes to the least-loaded live env workers, up to each one's capacity."""
        state = self.state
        if state is None:
            return
        now = time.monotonic()
        while state.queued:
            workers = [
                (info.outstanding, ident)
                for ident, info in self.peers.items()
                if info.role == "env_worker" and info.alive and info.outstanding < info.capacity
            ]
            if not workers:
                break
            _, worker = min(workers)
            task = state.queued.pop(0)
            task.worker = worker
            task.deadline = now + self.cfg.rollout.episode_timeout_s
            self.peers[worker].outstanding += 1
            state.in_flight[task.msg.episode_id] = task
            self.send_to(worker, task.msg)
        if not state.queued and not state.in_flight:
            state.rollout_done.set()

    def _episodes(self, iteration: int, version: int, train: bool, evaluate: bool) -> list[EpisodeTask]:
        """The iteration's episodes. Tree sampling runs one episode per problem (K candidates per turn
        inside it); parallel sampling runs K independent episodes of each problem. Evaluation runs
        eval.k episodes of each test problem (avg@k, pass@k)."""
        tasks = []
        if train:
            size = self.cfg.rollout.batch_size
            copies = self.cfg.algorithm.k if self.cfg.algorithm.sampling == "parallel" else 1
            for index in range(size):
                position = self._order[(iteration * size + index) % len(self._order)]
                for copy in range(copies):
                    seed = hash((self.cfg.run.seed, iteration, index, copy)) & 0x7FFFFFFF
                    suffix = f"-{copy}" if copies > 1 else ""
                    msg = RunEpisode(
                        f"train{iteration}-{index}{suffix}", iteration, "train", f"train{position}",
                        self.train_problems[position], seed, version,
                    )  # fmt: skip
                    tasks.append(EpisodeTask(msg))
        if evaluate:
            k = self.cfg.eval.k
            for index in range(min(self.cfg.eval.size, len(self.test_problems))):
                for copy in range(k):
                    suffix = f"-{copy}" if k > 1 else ""
                    msg = RunEpisode(
                        f"eval{iteration}-{index}{suffix}", iteration, "eval", f"test{index}",
                        self.test_problems[index], index * 1000 + copy, version,
                    )  # fmt: skip
                    tasks.append(EpisodeTask(msg))
        return tasks

    async def _watchdog(self) -> None:
        """Declare silent peers dead and drop episodes past their deadline."""
        while True:
            await asyncio.sleep(self.cfg.cluster.heartbeat_s)
            now = time.monotonic()
            for ident, info in self.peers.items():
                self.send_to(ident, Heartbeat(time.time()))
                if info.alive and now - info.last_seen > self.cfg.cluster.peer_timeout_s:
                    self._peer_died(ident, info)
            state = self.state
            if state is None:
                continue
            for episode_id, task in list(state.in_flight.items()):
                if now > task.deadline:
                    log.error("episode %s timed out; counted as dropped", episode_id)
                    self._on_episode_done(EpisodeDone(episode_id, state.iteration, task.msg.mode, "timed out", {}, {}))

    def _peer_died(self, ident: bytes, info: PeerInfo) -> None:
        info.alive = False
        if info.role == "inference":
            self._replicas[info.policy] = [r for r in self._replicas[info.policy] if r[0] != ident]
        name = ident.decode()
        if info.role != "env_worker":
            raise PeerDead(f"{name} (pid {info.pid}) has been silent for over {self.cfg.cluster.peer_timeout_s}s")
        log.error("%s is silent; re-dispatching its episodes", name)
        state = self.state
        if state is not None:
            for episode_id, task in list(state.in_flight.items()):
                if task.worker == ident:
                    del state.in_flight[episode_id]
                    state.queued.append(EpisodeTask(task.msg))
            self._dispatch()

    # -- the iteration barrier ---------------------------------------------------------------------

    async def main(self) -> None:
        try:
            await asyncio.wait_for(self.all_joined.wait(), self.cfg.cluster.startup_timeout_s)
        except TimeoutError:
            missing = sorted(self.expected - {p.decode() for p in self.peers})
            raise PeerDead(f"peers never joined within {self.cfg.cluster.startup_timeout_s}s: {missing}") from None
        log.info("all %d peers joined; starting", len(self.expected))
        if self.deployment.training:
            iterations, every = self.cfg.run.iterations, self.cfg.eval.every
            for iteration in range(self.start, iterations):
                evaluate = every > 0 and iteration % every == 0
                await self._iteration(iteration, evaluate=evaluate, train=True)
            await self._iteration(iterations, evaluate=every > 0, train=False)
        else:  # mas-async eval: one evaluation pass of the given weights
            row = await self._iteration(self.start, evaluate=True, train=False)
            (self.run_dir / "eval.json").write_text(json.dumps(row, indent=2))
        for ident in self.peers:
            self.send_to(ident, Shutdown("run finished", False))
        await asyncio.sleep(0.5)  # let the Shutdown messages leave (and any still in the outbox)

    async def _iteration(self, iteration: int, *, evaluate: bool, train: bool) -> dict[str, Any]:
        version = iteration
        state = self.state = IterationState(iteration, version, self.policies)
        t0 = time.monotonic()
        state.queued = self._episodes(iteration, version, train, evaluate)
        self._dispatch()
        await state.rollout_done.wait()
        rollout_s = time.monotonic() - t0
        if train and state.stats["train"].episodes == 0:
            raise RuntimeError(
                f"iteration {iteration}: every training episode failed; first error: {state.first_error}"
            )
        step_s = 0.0
        if train:
            t1 = time.monotonic()
            for policy in self.policies:
                msg = TrainStep(policy, iteration, version, state.forwarded[policy])
                self.send_to(f"trainer/{policy}".encode(), msg)
            await state.step_done.wait()
            step_s = time.monotonic() - t1
            if checkpoint_due(self.cfg, version + 1):
                save_router(self.run_dir, version + 1, {"iteration": iteration + 1})
        row = self._row(state, rollout_s, step_s, train)
        self.metrics.write(row)
        return row

    def _row(self, state: IterationState, rollout_s: float, step_s: float, train: bool) -> dict[str, Any]:
        row: dict[str, Any] = {"iteration": state.iteration}
        train_stats, eval_stats = state.stats["train"], state.stats["eval"]
        if train:
            means = train_stats.means()
            row["team/success_rate"] = means.get("success", 0.0)
            for key, value in means.items():
                if key.startswith("reward/"):
                    row[key] = value
            row["rollout/episodes"] = train_stats.episodes
            row["rollout/dropped"] = state.dropped["train"]
            row["rollout/turns"] = means.get("turns", 0.0)
        if eval_stats.episodes or state.dropped["eval"]:
            means = eval_stats.means()
            row["eval/team_success_rate"] = means.get("success", 0.0)
            k = self.cfg.eval.k
            row[f"eval/avg@{k}"] = means.get("success", 0.0)
            solved = state.eval_solved.values()
            row[f"eval/pass@{k}"] = sum(any(s) for s in solved) / max(1, len(solved))
            for key, value in means.items():
                if key.startswith("reward/"):
                    row[f"eval/{key}"] = value
            row["eval/episodes"] = eval_stats.episodes
        tokens = train_stats.tokens + eval_stats.tokens
        row["throughput/rollout_tokens_per_s"] = tokens / rollout_s if rollout_s > 0 else 0.0
        row["time/rollout_s"] = rollout_s
        if train:
            trained = state.trained
            row["time/train_s"] = max(m.get("time/train_s", 0.0) for m in trained.values())
            row["time/weight_sync_s"] = max(m.get("time/weight_sync_s", 0.0) for m in trained.values())
            row["time/step_s"] = step_s
            for policy, metrics in trained.items():
                row[f"policy/{policy}/version"] = state.version
                for key, value in metrics.items():
                    if not key.startswith("time/"):
                        row[f"policy/{policy}/{key}"] = value
        row["router/late_groups"] = state.late_groups
        row["router/malformed"] = self.malformed
        row["time/elapsed_s"] = time.monotonic() - self.started
        return row

    async def cleanup(self) -> None:
        self.metrics.close()
