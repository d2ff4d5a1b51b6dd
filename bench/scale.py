"""Scale simulator of the control plane: the real router against hundreds of simulated peers.

The middle is the real router process (`python -m mas_async.launch.process router`, as `bench/router.py`
starts it, configured as a training run with one shared policy). Every other process of a deployment is
simulated by a few worker processes (`--procs`), each running its share of the peers as asyncio callbacks
and tasks on uvloop, one DEALER socket per simulated peer, each joining with a Hello as the real peers do:

- inference replicas: continuous batching of up to B requests at once; a request's service time is
  `tokens_per_turn * K / per-request rate`, the rate being `tokens_per_s_per_gpu * gpus_per_replica / B`
  (every request of a full batch decodes at the same rate). The result is sent back with the real
  GenerateResult's frames (K completions of `tokens_per_turn` tokens and log-probs). On UpdateWeights a
  replica reports WeightsLoaded, as a real one does after the broadcast;
- env workers: each runs the episodes the router dispatches to it (RunEpisode, up to its Hello capacity);
  an episode is T turns of: Generate (n = K, a prompt of P token ids), wait for the result, an env step
  drawn from a lognormal (`--env-step-ms` median, `--env-step-sigma`); then what the real env worker
  sends at the end of an episode: its Groups (T * K samples of P + tokens_per_turn tokens) and EpisodeDone;
- the trainer: counts the samples that reach it (and checks each TrainStep's expected count), and
  answers TrainStep(v) after `--step-ms` with UpdateWeights(v+1) and Trained(v+1), so iterations go on;
- every peer sends a Heartbeat each heartbeat interval in which it sent nothing else, as the real ones do
  (`cluster.heartbeat_s`, `--heartbeat-s`, 1 s, or processes / `cluster.heartbeats_per_s` (500) where that is
  longer: 2.2 s at 1,024 replicas and 64 env workers).

With `--leases` (the default; `cluster.leases: true` in the router's config) each replica also binds a
direct socket and says its endpoint in its Hello; the router leases replicas to env workers (`Lease`), and an
env worker sends each Generate straight to the leased replica with the fewest of its requests outstanding,
which answers straight back. The trainer binds a direct socket too (its own key, its endpoint in its Hello),
which the router names to every env worker (`Trainers`): a worker sends each episode's Groups there (the rank
of RunEpisode.trainer_ranks), and the trainer counts them once the router's `Accepted` names that episode's
attempt, worker and sample count, waiting a bounded `GROUPS_WAIT_S` before a step for groups still on their
way. The router sees episodes, steps and heartbeats, neither requests nor samples. `--routed-groups` keeps
the Groups on the router (the fallback it still takes from a worker with no trainer link); `--no-leases`
measures the routed path (every Generate, result and Groups through the router).

The run keeps `rollout.max_staleness` = `--staleness` (1) iterations ahead open, each iteration a batch of
half the concurrent episodes, so rollouts go on across steps (strict mode drains every iteration).

A point of the sweep is (replicas, concurrent episodes E). E sets the offered load: the requests/s the
episodes would send if the control plane added nothing, L = E / cycle, cycle = service time + mean env step
(with the defaults, 4,096 episodes offer ~6,900 requests/s), on ceil(E / C) env workers (`--episodes-per-worker`
C). So that replicas never queue (the router is what is measured), a replica of a point serves max(B, ceil(E / replicas))
requests at once, each at the same service time. Per point, over a measured window after a warm-up:
requests/s (through the router, or straight to the replicas with leases); router CPU per request (user + system of the router process, delta over the
window / requests answered in it); the latency the control plane adds to each request, measured per
request (the end-to-end time seen by the env worker minus the service time its replica measured for it,
receipt to send), p50 and p99; requests in transit (Little's law: requests/s * mean added latency); router
RSS; samples/s reaching the trainer; episodes done/s and the router's CPU per episode done (with leases
the router's work is per episode, not per request); the simulator's own event-loop lag (it is inside the added latency);
over the whole run, the Groups sent through the router and straight, and the trainer's accepted and
delivered episodes (`GROUP_COUNTS`); the router log's warnings up to the window's end;
and per replica count the saturation point: where requests/s stops growing with the offered load (below
0.85 of the lowest point's achieved/offered ratio) or p99 added latency passes `--p99-bound-ms`.

Then the deployment check: a deployment of N GPUs at R tokens/s/GPU, T tokens per turn, K candidates per
request sends N * R / (T * K) requests/s; with leases and Groups straight to the trainers the router sees
episodes, not requests, so its load is that rate over the turns per episode (`--deployment-turns`). The
router's CPU at that load is measured where a point reached it (`--turns 1`: the same episodes/s from fewer
simulated requests), else read from the line through the loads measured (`--iteration-episodes`: one
iteration size at every load), else bounded by the CPU per episode at the most load. The loop's lag is the p99
over all the window's ticks (the router's metrics rows count them: router/loop_lag.py). One core of this
machine is taken as one server core (a fixed pure-Python workload's time is printed beside it, to compare
machines).

    python bench/scale.py                                   # the sweep (~2.5 min on 2 cores), then the 1,024-GPU check
    python bench/scale.py --gpus 256 --tokens-per-turn 200  # the check for another deployment
    python bench/scale.py --replicas 1024 --episodes 2048   # one point
    python bench/scale.py --replicas 1024 --episodes 2048 4096 --turns 1 --prompt-tokens 64 --deployment-turns 4 \
        --iteration-episodes 2048 --seconds 20 --router-core 0  # the router at the 1,024-GPU deployment's load
    python bench/scale.py --json F.json --plot docs/images/scale.png
    python bench/scale.py --smoke                           # seconds; run by the tests
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import multiprocessing as mp
import os
import queue
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import zmq

import mas_async
from mas_async.deployment import trainer_peer
from mas_async.metrics import Keys as MetricKeys
from mas_async.router.loop_lag import OVER_MS, pooled_percentile
from mas_async.runtime.curve import secure_client
from mas_async.wire.codec import pack, unpack
from mas_async.wire.messages import (
    PROTOCOL_VERSION,
    EpisodeDone,
    Generate,
    GenerateResult,
    Groups,
    GroupsReceived,
    Heartbeat,
    Hello,
    Kind,
    Trained,
    UpdateWeights,
    WeightsLoaded,
    decode,
    encode,
    samples_to_wire,
)
from mas_async.wire.samples import Sample

ROOT = Path(__file__).resolve().parents[1]

POLICY = "shared"
GENERATE = bytes([Kind.GENERATE])
RESULT = bytes([Kind.GENERATE_RESULT])
GROUPS = bytes([Kind.GROUPS])
REQUEST_TIMEOUT_S = 60.0
"""Bound of one simulated Generate (a request that takes longer fails its episode, counted as an error)."""
JOIN_TIMEOUT_S = 120.0
"""Bound of the wait for every simulated peer's Welcome, and for the reports at the end."""
GROUPS_WAIT_S = 5.0
"""With leases: how long the trainer waits before a step for the groups of episodes the router accepted
(they come from the env workers on other connections); those still missing then are counted."""
GROUP_COUNTS = {
    "via_router": "Groups the env workers sent through the router (with leases: a worker with no trainer link)",
    "straight": "Groups the env workers sent straight to the trainer's direct socket",
    "forwarded": "Groups the router forwarded to the trainer",
    "accepted": "episodes the router named in Accepted (their Groups went straight)",
    "accepted_messages": "Accepted messages the trainer got",
    "delivered": "Groups on the direct socket matched to their acceptance: the same worker and sample count",
    "missing": "accepted episodes whose Groups had not come when the trainer stepped (GROUPS_WAIT_S)",
    "unaccepted": "Groups on the direct socket whose episode was not accepted when its iteration stepped",
    "refused": "Groups on the direct socket from another worker or with another count than accepted, a second "
    "copy, or of an iteration stepped",
}
"""What each simulator counts of the episodes' Groups over the whole run (summed into `groups_<key>`)."""


def env_name(i: int) -> str:
    return f"env_worker/{i}"


def replica_name(i: int) -> str:
    return f"inference/{POLICY}/{i}"


TRAINER = f"trainer/{POLICY}"


# ---- the model of a deployment ------------------------------------------------------------------------


def service_s(args: argparse.Namespace) -> float:
    """One request's service time at a replica: tokens_per_turn * K tokens at the per-request rate."""
    per_request_rate = args.tokens_per_s_per_gpu * args.gpus_per_replica / args.batch
    return args.tokens_per_turn * args.k / per_request_rate


def cycle_s(args: argparse.Namespace) -> float:
    """One turn of an episode with nothing added: service time plus the env step's mean (lognormal)."""
    return service_s(args) + args.env_step_ms / 1000 * math.exp(args.env_step_sigma**2 / 2)


def deployment_rate(gpus: int, tokens_per_s_per_gpu: float, tokens_per_turn: int, k: int) -> float:
    """Requests/s of a deployment whose GPUs all decode at full rate: each request is K x tokens_per_turn."""
    return gpus * tokens_per_s_per_gpu / (tokens_per_turn * k)


def plan_point(args: argparse.Namespace, replicas: int, episodes: int) -> dict[str, Any]:
    """What a point of the sweep runs: E concurrent episodes (offering E / cycle requests/s) over
    ceil(E / C) env workers, iterations of `--iteration-episodes` or E / (staleness + 1) episodes, replicas
    serving up to max(B, ceil(E / replicas)) requests each."""
    iterations_open = args.staleness + 1
    episodes = max(iterations_open, episodes // iterations_open * iterations_open)
    workers = math.ceil(episodes / args.episodes_per_worker)
    capacities = [episodes // workers + (1 if i < episodes % workers else 0) for i in range(workers)]
    return {
        "replicas": replicas,
        "offered_rps": episodes / cycle_s(args),
        "episodes": episodes,
        "env_workers": workers,
        "capacities": capacities,
        "batch_size": args.iteration_episodes or episodes // iterations_open,
        "replica_batch": max(args.batch, math.ceil(episodes / replicas)),
    }


# ---- one simulated peer's socket ---------------------------------------------------------------------


class Link:
    """One simulated peer's DEALER socket to the router, identity = the peer's name (a CURVE client with the
    peer's own key when the run has keys), or to a replica's direct socket (`server_key`: the replica's
    public key). No high-water mark: a simulated peer never drops or blocks on a message, so what queues is
    the router's. LINGER 0: closed at once at the end. Driven as the router drives its own socket: the
    (edge-triggered) descriptor is watched with `add_reader`, every wake-up takes every queued message, and
    every send schedules one more look, since a send may consume the notification."""

    def __init__(
        self, ctx: zmq.Context, name: str, endpoint: str, keys: tuple[str, str] | None, handler: Any,
        server_key: str | None = None,
    ) -> None:  # fmt: skip
        sock = _socket(ctx, zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, name.encode())
        if keys is not None:
            secure_client(sock, keys[0], keys[1])
            if server_key is not None:  # a replica's direct socket (leases), not the router's
                sock.curve_serverkey = server_key.encode()
        sock.connect(endpoint)
        self.name = name
        self._watch(sock, handler)

    def _watch(self, sock: zmq.Socket, handler: Any) -> None:
        self.sock = sock
        self.handler = handler
        self.loop = asyncio.get_running_loop()
        self.fd = sock.getsockopt(zmq.FD)
        self.loop.add_reader(self.fd, self.readable)
        self._looking = False
        self.sent_at = float("-inf")
        """When this link last sent (time.perf_counter()): a peer that sent within a heartbeat skips it."""

    def readable(self) -> None:
        self._looking = False
        sock = self.sock
        if sock.closed:  # (a look scheduled by a send just before the close)
            return
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self.handler(sock.recv_multipart(zmq.NOBLOCK, copy=False))

    def send(self, frames: list) -> None:
        if self.sock.closed:  # (a replica's timer or an episode after the end: dropped)
            return
        self.sock.send_multipart(frames, copy=False)
        self.sent_at = time.perf_counter()
        if not self._looking:
            self._looking = True
            self.loop.call_soon(self.readable)

    def close(self) -> None:
        self.loop.remove_reader(self.fd)
        self.sock.close(linger=0)


class DirectSocket(Link):
    """A simulated replica's or trainer's ROUTER socket for what env workers send it straight (leases: the
    Generates, the Groups): bound on loopback at a free port (`endpoint`), a CURVE server with the peer's own
    key when the run has keys. Unlike the real ones, no ZAP handler checks the client's key (any client that
    knows the peer's public key is let in: the crypto is what costs, and it is the same), so a connection is
    named by its socket identity, the env worker's name; the handler gets [routing id, *frames] and answers
    with `send([routing id, *frames])`."""

    def __init__(self, ctx: zmq.Context, secret: str | None, handler: Any) -> None:
        sock = _socket(ctx, zmq.ROUTER)
        if secret is not None:
            sock.curve_secretkey = secret.encode()
            sock.curve_publickey = zmq.curve_public(secret.encode())
            sock.curve_server = True
        self.endpoint = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.name = "direct"
        self._watch(sock, handler)


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


# ---- the simulated peers ----------------------------------------------------------------------------


class SimPeer:
    """A simulated peer: its Link, its Hello, and the Welcome it waits for."""

    role = ""
    policy = ""

    def __init__(self, sim: Sim, name: str, capacity: int) -> None:
        self.sim = sim
        self.name = name
        self.capacity = capacity
        self.link = Link(sim.ctx, name, sim.endpoint, sim.keys_of(name), self.on_frames)
        self.welcomed = sim.loop.create_future()

    endpoint = ""
    """A replica's or the trainer's direct endpoint (leases), said in its Hello."""

    def hello(self) -> None:
        hello = Hello(
            self.role, self.name, self.policy, self.capacity, PROTOCOL_VERSION, os.getpid(), 0.0, self.endpoint
        )
        self.link.send(encode(hello))

    def on_frames(self, frames: list) -> None:
        kind = frames[0].bytes[0]
        if kind == Kind.WELCOME:
            if not self.welcomed.done():
                self.welcomed.set_result(True)
        elif kind == Kind.SHUTDOWN:
            self.sim.shutdown_reason = decode([f.buffer for f in frames]).reason  # type: ignore[attr-defined]
        else:
            self.on_message(kind, frames)

    def on_message(self, kind: int, frames: list) -> None:  # heartbeats and orders the simulation ignores
        pass


class SimReplica(SimPeer):
    """An inference replica: up to `batch` requests served at once, `service` seconds each, the rest
    waiting in order; records (origin, request id, service time measured here, receipt to send)."""

    role = "inference"
    policy = POLICY

    def __init__(self, sim: Sim, name: str, batch: int, service: float, result_payload: bytes) -> None:
        super().__init__(sim, name, batch)
        self.batch, self.service, self.payload = batch, service, result_payload
        self.active = 0
        self.waiting: deque[tuple[int, str, float, bytes | None]] = deque()
        self.direct: DirectSocket | None = None
        if sim.spec["leases"]:
            keys = sim.keys_of(name)
            self.direct = DirectSocket(sim.ctx, None if keys is None else keys[1], self.on_direct)
            self.endpoint = self.direct.endpoint

    def on_direct(self, frames: list) -> None:
        """A Generate straight from an env worker: [routing id, kind, header, payload]."""
        if frames[1].bytes[0] == Kind.GENERATE:
            self.accept(frames[2], frames[0].bytes)

    def accept(self, header: Any, route: bytes | None) -> None:
        request_id, _policy, origin, _deadline = unpack(header.buffer)
        request = (request_id, origin, time.perf_counter(), route)
        if self.active < self.batch:
            self.start(request)
        else:
            self.waiting.append(request)

    def on_message(self, kind: int, frames: list) -> None:
        if kind == Kind.GENERATE:
            self.accept(frames[1], None)
        elif kind == Kind.UPDATE_WEIGHTS:
            msg = decode([f.buffer for f in frames])
            self.link.send(encode(WeightsLoaded(POLICY, msg.version, self.name, "")))  # type: ignore[attr-defined]

    def start(self, request: tuple[int, str, float, bytes | None]) -> None:
        self.active += 1
        self.sim.loop.call_later(self.service, self.finish, request)

    def finish(self, request: tuple[int, str, float, bytes | None]) -> None:
        request_id, origin, received, route = request
        result = [RESULT, pack([request_id, origin, ""]), self.payload]
        if route is None:
            self.link.send(result)
        else:
            assert self.direct is not None
            self.direct.send([route, *result])
        self.sim.served.append((origin, request_id, time.perf_counter() - received, route is not None))
        self.active -= 1
        if self.waiting:
            self.start(self.waiting.popleft())


class SimEnvWorker(SimPeer):
    """An env worker: runs each dispatched episode as a task of T turns (Generate, wait, env step), then
    sends the episode's Groups (straight to its trainer rank when linked, else through the router) and
    EpisodeDone; records (request id, sent, answered) per request."""

    role = "env_worker"

    def __init__(self, sim: Sim, name: str, capacity: int, seed: int) -> None:
        super().__init__(sim, name, capacity)
        spec = sim.spec
        self.rng = random.Random(seed)
        self.ids = itertools.count()
        self.pending: dict[int, asyncio.Future] = {}
        prompt = np.arange(spec["prompt_tokens"], dtype=np.int32) % 1000
        request = Generate(0, POLICY, name, 0.0, prompt, spec["k"], spec["tokens_per_turn"], 1.0, 1.0, False, [0])
        self.generate_payload = encode(request)[2]
        self.tasks: set[asyncio.Task] = set()
        self.leased: dict[str, Link] = {}
        """Replica name -> this worker's link to its direct socket (leases)."""
        self.outstanding: dict[str, int] = {}
        """Replica name -> requests sent to it and not answered yet."""
        self.sent_to: dict[int, str] = {}
        """Request id -> the replica it was sent to straight."""
        self.trainers: dict[str, Link] = {}
        """Trainer name -> this worker's link to its direct socket (leases, `Trainers`)."""
        self.received: dict[tuple[int, str, int], asyncio.Future] = {}
        """(iteration, episode, attempt) -> the trainer's answer to its straight Groups (`GroupsReceived`)."""

    def on_message(self, kind: int, frames: list) -> None:
        if kind == Kind.GENERATE_RESULT:
            self.on_result(frames)
        elif kind == Kind.LEASE:
            self.lease(decode([f.buffer for f in frames]))
        elif kind == Kind.TRAINERS:
            if self.sim.spec["direct_groups"]:  # (--routed-groups: no trainer link, every Groups via the router)
                self.connect_trainers(decode([f.buffer for f in frames]))
        elif kind == Kind.GROUPS_RECEIVED:  # (from a trainer's direct socket)
            _policy, iteration, episode_id, attempt = unpack(frames[1].buffer)
            future = self.received.get((iteration, episode_id, attempt))
            if future is not None and not future.done():
                future.set_result(None)
        elif kind == Kind.RUN_EPISODE:
            task = self.sim.loop.create_task(self.episode(decode([f.buffer for f in frames])))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def on_result(self, frames: list) -> None:
        request_id = unpack(frames[1].buffer)[0]
        replica = self.sent_to.pop(request_id, None)
        if replica is not None and replica in self.outstanding:
            self.outstanding[replica] -= 1
        future = self.pending.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(time.perf_counter())

    def lease(self, msg: Any) -> None:
        """The replicas this worker may send to straight: links to the new ones, the gone ones closed (the
        simulation loses no replica, so nothing is in flight to them)."""
        names = {name: endpoint for name, endpoint in msg.replicas}
        for name in [n for n in self.leased if n not in names]:
            self.leased.pop(name).close()
            self.outstanding.pop(name, None)
        keys = self.sim.keys_of(self.name)
        for name, endpoint in names.items():
            if name not in self.leased:
                server = self.sim.keys_of(name)
                server_key = None if server is None else zmq.curve_public(server[1].encode()).decode()
                self.leased[name] = Link(self.sim.ctx, self.name, endpoint, keys, self.on_frames, server_key)
                self.outstanding[name] = 0

    def connect_trainers(self, msg: Any) -> None:
        """Links to the trainers' direct sockets (CURVE clients requiring each trainer's public key)."""
        keys = self.sim.keys_of(self.name)
        for name, endpoint in msg.endpoints:
            if name not in self.trainers:
                server = self.sim.keys_of(name)
                server_key = None if server is None else zmq.curve_public(server[1].encode()).decode()
                self.trainers[name] = Link(self.sim.ctx, self.name, endpoint, keys, self.on_frames, server_key)

    async def send_groups(self, msg: Any, frames: list) -> None:
        """An episode's Groups: straight to the trainer rank its RunEpisode names (rank 0 when it names none)
        when linked to it, returning once the trainer answered (a real worker sends its EpisodeDone only
        then; no answer within `GROUPS_WAIT_S` is counted as an error), else through the router."""
        link = self.trainers.get(trainer_peer(POLICY, msg.trainer_ranks.get(POLICY, 0)))
        if link is None:
            self.link.send(frames)
            self.sim.groups["via_router"] += 1
            return
        key = (msg.iteration, msg.episode_id, msg.attempt)
        answer = self.received[key] = self.sim.loop.create_future()
        link.send(frames)
        self.sim.groups["straight"] += 1
        try:
            await asyncio.wait_for(answer, GROUPS_WAIT_S)
        except TimeoutError:
            self.sim.errors += 1
        finally:
            self.received.pop(key, None)

    def send_generate(self, request_id: int, frames: list) -> None:
        """Straight to the leased replica with the fewest of this worker's requests, else via the router."""
        if not self.outstanding:
            self.link.send(frames)
            return
        replica = min(self.outstanding, key=self.outstanding.__getitem__)
        self.outstanding[replica] += 1
        self.sent_to[request_id] = replica
        self.leased[replica].send(frames)

    async def episode(self, msg: Any) -> None:
        spec, sim = self.sim.spec, self.sim
        error = ""
        try:
            for _turn in range(spec["turns"]):
                request_id = next(self.ids)
                future = sim.loop.create_future()
                self.pending[request_id] = future
                sent = time.perf_counter()
                header = pack([request_id, POLICY, self.name, time.time() + REQUEST_TIMEOUT_S])
                self.send_generate(request_id, [GENERATE, header, self.generate_payload])
                try:
                    async with asyncio.timeout(REQUEST_TIMEOUT_S):
                        answered = await future
                finally:
                    self.pending.pop(request_id, None)
                sim.requests.append((self.name, request_id, sent, answered))
                await asyncio.sleep(self.rng.lognormvariate(spec["env_step_mu"], spec["env_step_sigma"]))
        except TimeoutError:
            error = f"a request timed out after {REQUEST_TIMEOUT_S}s"
            sim.errors += 1
        samples = {}
        if not error:
            n, tokens = spec["samples"], spec["sample_tokens"]
            header = pack([POLICY, msg.iteration, msg.episode_id, msg.attempt, n, tokens])
            await self.send_groups(msg, [GROUPS, header, sim.groups_payload])
            samples = {POLICY: n}
        summary = {"success": 0.0, "turns": spec["turns"], "tokens": spec["sample_tokens"]}
        done = EpisodeDone(msg.episode_id, msg.iteration, msg.mode, msg.attempt, error, summary, samples)
        self.link.send(encode(done))
        sim.episodes.append(time.perf_counter())


class SimTrainer(SimPeer):
    """The policy's trainer (rank 0): counts the samples of each iteration that reach it, the Groups the
    router forwards and, with leases, those the env workers send straight to its direct socket once the
    router's `Accepted` names their (iteration, episode, attempt) with the same worker and sample count (a
    real trainer trains only those); checks each TrainStep's expected count against them, waiting up to
    `GROUPS_WAIT_S` for accepted episodes' Groups still on their way; steps in `step_s` and reports,
    announcing the broadcast first."""

    role = "trainer"
    policy = POLICY

    def __init__(self, sim: Sim, step_s: float) -> None:
        super().__init__(sim, TRAINER, 0)
        self.step_s = step_s
        self.received: dict[int, int] = {}
        """Iteration -> samples that count: forwarded by the router, or straight and accepted."""
        self.arrived: dict[tuple[int, str, int], tuple[str, int]] = {}
        """Straight Groups not accepted yet: (iteration, episode, attempt) -> (sender, samples)."""
        self.accepted: dict[tuple[int, str, int], tuple[str, int]] = {}
        """Accepted episodes whose Groups have not come yet: (iteration, episode, attempt) -> (worker, samples)."""
        self.stepped = -1
        """The last iteration stepped: straight Groups of it or earlier are refused."""
        self.changed = asyncio.Event()
        """Set on each delivery (a step waiting for its iteration's Groups looks again)."""
        self.tasks: set[asyncio.Task] = set()
        self.direct: DirectSocket | None = None
        if sim.spec["leases"]:  # (the router refuses a trainer's Hello without an endpoint when leasing)
            keys = sim.keys_of(TRAINER)
            self.direct = DirectSocket(sim.ctx, None if keys is None else keys[1], self.on_direct)
            self.endpoint = self.direct.endpoint

    def on_message(self, kind: int, frames: list) -> None:
        groups = self.sim.groups
        if kind == Kind.GROUPS:
            _policy, iteration, _episode, _attempt, n_samples, _tokens = unpack(frames[1].buffer)
            groups["forwarded"] += 1
            self.count(iteration, n_samples)
        elif kind == Kind.ACCEPTED:
            msg = decode([f.buffer for f in frames])
            groups["accepted_messages"] += 1
            for episode_id, attempt, worker, samples in msg.episodes:  # type: ignore[attr-defined]
                key = (msg.iteration, episode_id, attempt)  # type: ignore[attr-defined]
                groups["accepted"] += 1
                if key in self.arrived:
                    self.match(key, *self.arrived.pop(key), worker, samples)
                else:
                    self.accepted[key] = (worker, samples)
        elif kind == Kind.TRAIN_STEP:
            task = self.sim.loop.create_task(self.step(decode([f.buffer for f in frames])))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def on_direct(self, frames: list) -> None:
        """Groups straight from an env worker: [routing id (the worker's name), kind, header, payload]."""
        groups = self.sim.groups
        if frames[1].bytes[0] != Kind.GROUPS:
            groups["refused"] += 1
            return
        policy, iteration, episode_id, attempt, n_samples, _tokens = unpack(frames[2].buffer)
        key, sender = (iteration, episode_id, attempt), frames[0].bytes.decode()
        # Answered at once, as a real trainer does (`GroupsReceived`): the worker's EpisodeDone waits for it.
        self.direct.send([frames[0], *encode(GroupsReceived(policy, iteration, episode_id, attempt, ""))])
        if iteration <= self.stepped or key in self.arrived:
            groups["refused"] += 1
        elif key in self.accepted:
            self.match(key, sender, n_samples, *self.accepted.pop(key))
        else:
            self.arrived[key] = (sender, n_samples)

    def match(self, key: tuple[int, str, int], sender: str, n_samples: int, worker: str, accepted: int) -> None:
        """Straight Groups and their acceptance: they count if the same worker sent that many samples."""
        if sender != worker or n_samples != accepted:
            self.sim.groups["refused"] += 1
            return
        self.sim.groups["delivered"] += 1
        self.count(key[0], n_samples)
        self.changed.set()

    def count(self, iteration: int, n_samples: int) -> None:
        self.received[iteration] = self.received.get(iteration, 0) + n_samples
        self.sim.samples.append((time.perf_counter(), n_samples))

    async def step(self, msg: Any) -> None:
        if self.direct is not None:
            await self.wait_for(msg.iteration)
            self.stepped = max(self.stepped, msg.iteration)
            for table, what in ((self.accepted, "missing"), (self.arrived, "unaccepted")):
                for key in [key for key in table if key[0] <= msg.iteration]:
                    del table[key]
                    self.sim.groups[what] += 1
        if self.received.pop(msg.iteration, 0) != msg.expected_samples:
            self.sim.mismatches += 1
        await asyncio.sleep(self.step_s)
        version = msg.version + 1
        self.link.send(encode(UpdateWeights(POLICY, version, 0)))
        self.link.send(encode(Trained(POLICY, version, "", {})))
        self.sim.steps += 1

    async def wait_for(self, iteration: int) -> None:
        """Until every accepted episode of `iteration` has its Groups here, or `GROUPS_WAIT_S` passed."""
        deadline = self.sim.loop.time() + GROUPS_WAIT_S
        while any(key[0] == iteration for key in self.accepted):
            left = deadline - self.sim.loop.time()
            if left <= 0:
                return
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)


class Sim:
    """One simulator process: its share of the peers on one event loop, until the parent says stop."""

    def __init__(self, spec: dict[str, Any], stop: Any) -> None:
        self.spec = spec
        self.stop = stop
        self.endpoint = spec["endpoint"]
        self.loop = asyncio.get_running_loop()
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 16384)  # (libzmq's default, 1,023, is less than a point's sockets with leases)
        self.requests: list[tuple[str, int, float, float]] = []
        self.served: list[tuple[str, int, float, bool]] = []
        """(origin, request id, service time measured at the replica, whether it came straight)."""
        self.samples: list[tuple[float, int]] = []
        self.episodes: list[float] = []
        """When each EpisodeDone was sent."""
        self.lag: list[tuple[float, float]] = []
        self.queued: list[tuple[float, int]] = []
        self.errors = self.mismatches = self.steps = 0
        self.groups: Counter[str] = Counter()
        """The Groups counts of `GROUP_COUNTS`."""
        self.shutdown_reason = ""
        # An episode's samples as the env worker sends them: T turns of K candidates, the K of a turn sharing
        # its prompt (sent once: `samples_to_wire`), each turn's prompt its own.
        samples = [
            Sample(
                f"e/a/{turn}", "e", "p", "a", POLICY, turn, np.full(spec["prompt_tokens"], turn, np.int32),
                np.zeros(spec["tokens_per_turn"], np.int32), np.zeros(spec["tokens_per_turn"], np.float32), 0, 0.0,
            )
            for turn in range(spec["turns"])
            for _ in range(spec["k"])
        ]  # fmt: skip
        wire = samples_to_wire(samples)
        self.groups_payload = encode(Groups(POLICY, 0, "", 0, 0, 0, wire))[2]

    def keys_of(self, name: str) -> tuple[str, str] | None:
        keys = self.spec["keys"]
        return None if keys is None else (keys[0], keys[1][name])

    async def run(self) -> dict[str, Any]:
        spec = self.spec
        completion = [np.zeros(spec["tokens_per_turn"], np.int32), np.zeros(spec["tokens_per_turn"], np.float32), 0]
        result_payload = encode(GenerateResult(0, "", "", [[*completion, "length"]] * spec["k"]))[2]
        peers: list[SimPeer] = []
        trainer = SimTrainer(self, spec["step_s"]) if spec["trainer"] else None
        if trainer is not None:
            peers.append(trainer)
        replicas = [
            SimReplica(self, replica_name(i), spec["replica_batch"], spec["service_s"], result_payload)
            for i in spec["replicas"]
        ]
        workers = [SimEnvWorker(self, env_name(i), c, seed=i) for i, c in spec["env_workers"]]
        peers += replicas + workers
        for peer in peers:
            peer.hello()
        async with asyncio.timeout(JOIN_TIMEOUT_S):
            await asyncio.gather(*(p.welcomed for p in peers))
        spec["out"].put(("ready", spec["index"], None))
        deadline = time.perf_counter() + spec["max_s"]
        beat = lag_at = time.perf_counter()
        while not self.stop.is_set() and time.perf_counter() < deadline and not self.shutdown_reason:
            await asyncio.sleep(0.02)
            now = time.perf_counter()
            self.lag.append((now, now - lag_at - 0.02))  # how late this loop runs a 20 ms timer
            self.queued.append((now, sum(len(r.waiting) for r in replicas)))
            lag_at = now
            if now - beat >= spec["heartbeat_s"]:
                beat = now
                beat_frames = encode(Heartbeat(time.time()))
                for peer in peers:
                    if now - peer.link.sent_at >= spec["heartbeat_s"]:
                        peer.link.send(beat_frames)
        for worker in workers:
            for task in worker.tasks:
                task.cancel()
        if trainer is not None:
            for task in trainer.tasks:
                task.cancel()
        for peer in peers:
            peer.link.close()
        for worker in workers:
            for link in [*worker.leased.values(), *worker.trainers.values()]:
                link.close()
        for peer in [*replicas, trainer]:
            if peer is not None and peer.direct is not None:
                peer.direct.close()
        self.ctx.term()
        return {
            "requests": self.requests,
            "served": self.served,
            "samples": self.samples,
            "episodes": self.episodes,
            "lag": self.lag,
            "queued": self.queued,
            "errors": self.errors,
            "mismatches": self.mismatches,
            "groups": dict(self.groups),
            "steps": self.steps,
            "shutdown": self.shutdown_reason,
        }


def sim_process(spec: dict[str, Any], stop: Any) -> None:
    """Entry point of a simulator process; puts ("ready", i, None), then ("report", i, figures)."""
    import uvloop

    async def main() -> dict[str, Any]:
        return await Sim(spec, stop).run()

    try:
        report = uvloop.run(main())
    except BaseException as e:
        spec["out"].put(("failed", spec["index"], f"{type(e).__name__}: {e}"))
        raise
    spec["out"].put(("report", spec["index"], report))


# ---- one point: the router and the simulators -----------------------------------------------------


Keys = tuple[str, dict[str, str]] | None


def start_router(args: argparse.Namespace, run_dir: Path, plan: dict[str, Any]) -> tuple[str, Keys, subprocess.Popen]:
    """The real router as its own process, configured for the point's peers; returns its endpoint, the run's
    keys (the folder and every process's secret key; None without CURVE) and the process."""
    from mas_async.config import dump_config, load_config
    from mas_async.deployment import Deployment, free_ports
    from mas_async.runtime.curve import SECRET_ENV, issued_secret, prepare_keys

    overrides = [
        f"run.output_dir={run_dir}",
        "run.iterations=1000000",
        "eval.every=0",
        "env.train_size=64",
        "env.test_size=1",
        f"algorithm.k={args.k}",
        f"rollout.batch_size={plan['batch_size']}",
        f"rollout.max_staleness={args.staleness}",
        f"rollout.episodes_per_worker={args.episodes_per_worker}",
        f"rollout.max_tokens={args.tokens_per_turn}",
        "rollout.episode_timeout_s=600",
        f"cluster.env_workers={plan['env_workers']}",
        f"policies.{POLICY}.replicas={plan['replicas']}",
        "cluster.peer_timeout_s=120",
        f"cluster.heartbeat_s={args.heartbeat_s}",
        f"cluster.curve={str(args.curve).lower()}",
        f"cluster.leases={str(args.leases).lower()}",
        "trainer.checkpoint_every=0",
        "metrics.tensorboard=false",
    ]
    config = load_config(ROOT / "configs" / "plan_path_tiny_shared.yaml", overrides)
    plan["heartbeat_s"] = config.heartbeat_interval_s()  # the simulated peers' interval, as the real ones'
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    dump_config(config, run_dir / "config.yaml")
    endpoint = f"tcp://127.0.0.1:{free_ports('127.0.0.1', 1)[0]}"
    names = [TRAINER, *map(replica_name, range(plan["replicas"])), *map(env_name, range(plan["env_workers"]))]
    keys_dir = prepare_keys(config, run_dir, names)
    keys = None if keys_dir is None else (keys_dir, {name: issued_secret(keys_dir, name) for name in names})
    Deployment(endpoint, {POLICY: 0}, {POLICY: ""}, keys_dir=keys_dir).save(run_dir / "deployment.json")
    secret = {} if keys_dir is None else {SECRET_ENV: issued_secret(keys_dir, "router")}
    profile = ["-m", "cProfile", "-o", str(args.profile)] if args.profile else []
    with (run_dir / "logs" / "router.log").open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, *profile, "-m", "mas_async.launch.process", "router", str(run_dir)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "MAS_ASYNC_LOG_LEVEL": "WARNING", **secret},
        )
    return endpoint, keys, proc


def _pin(core: int, router: Any, others: list[Any]) -> None:
    """Every thread of the router on `core`, every thread of `others` (the simulators) on the other cores: the
    router's loop then waits for its own work only (threads made later inherit it)."""
    rest = os.sched_getaffinity(0) - {core}
    if core not in os.sched_getaffinity(0) or not rest:
        raise SystemExit(f"--router-core {core}: this process may run on cores {sorted(os.sched_getaffinity(0))}; "
                         "the router needs one of them and the simulators at least one other")  # fmt: skip
    for proc, cores in [(router, {core}), *((other, rest) for other in others)]:
        for thread in proc.threads():
            os.sched_setaffinity(thread.id, cores)


def _cores_of(proc: Any) -> list[int]:
    """The cores any thread of `proc` may run on."""
    cores: set[int] = set()
    for thread in proc.threads():
        try:
            cores |= os.sched_getaffinity(thread.id)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    return sorted(cores)


def _cpu(proc: Any) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _main_thread_cpu(proc: Any) -> float:
    """CPU seconds of the process's main thread (the router's event loop; the others are libzmq's I/O
    threads, where CURVE encrypts and the sockets' TCP work happens)."""
    return next((t.user_time + t.system_time for t in proc.threads() if t.id == proc.pid), float("nan"))


def _percentile(values: list[float] | np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def measure_point(args: argparse.Namespace, replicas: int, episodes: int, run_dir: Path) -> dict[str, Any]:
    """Run one point: start the router and the simulators, measure over the window, tear everything down."""
    import psutil

    plan = plan_point(args, replicas, episodes)
    spawn = mp.get_context("spawn")
    out, stop = spawn.Queue(), spawn.Event()
    endpoint, keys, router = start_router(args, run_dir, plan)
    _wait_bound(endpoint, router, run_dir)  # (before the replicas bind ports of their own: none may take its port)
    sims: list[Any] = []
    reports: dict[int, dict[str, Any]] = {}
    try:
        procs = min(args.procs, replicas + plan["env_workers"])
        common = {
            "endpoint": endpoint,
            "keys": keys,
            "out": out,
            "k": args.k,
            "prompt_tokens": args.prompt_tokens,
            "tokens_per_turn": args.tokens_per_turn,
            "turns": args.turns,
            "env_step_mu": math.log(args.env_step_ms / 1000),
            "env_step_sigma": args.env_step_sigma,
            "samples": args.turns * args.k,
            "sample_tokens": args.turns * args.k * (args.prompt_tokens + args.tokens_per_turn),
            "service_s": service_s(args),
            "replica_batch": plan["replica_batch"],
            "step_s": args.step_ms / 1000,
            "heartbeat_s": plan["heartbeat_s"],
            "leases": args.leases,
            "direct_groups": args.leases and not args.routed_groups,
            "max_s": args.warmup + args.seconds + JOIN_TIMEOUT_S + 60,
        }
        for index in range(procs):
            spec = {
                **common,
                "index": index,
                "trainer": index == 0,
                "replicas": list(range(index, replicas, procs)),
                "env_workers": list(enumerate(plan["capacities"]))[index::procs],
            }
            sims.append(spawn.Process(target=sim_process, args=(spec, stop), daemon=True))
        for sim in sims:
            sim.start()

        def take(kind: str, deadline: float) -> dict[int, Any]:
            got: dict[int, Any] = {}
            while len(got) < len(sims):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited past the bound for the simulators' {kind!r} ({len(got)}/{len(sims)})")
                if router.poll() is not None:
                    raise RuntimeError(f"the router exited ({router.returncode}):\n{_log_tail(run_dir)}")
                try:
                    what, index, value = out.get(timeout=0.5)
                except queue.Empty:
                    if any(not s.is_alive() and s.exitcode for s in sims):
                        raise RuntimeError("a simulator process died") from None
                    continue
                if what == "failed":
                    raise RuntimeError(f"simulator {index} failed: {value}\n{_log_tail(run_dir)}")
                if what == kind:
                    got[index] = value
            return got

        take("ready", time.monotonic() + JOIN_TIMEOUT_S)
        router_ps = psutil.Process(router.pid)
        sim_ps = [psutil.Process(s.pid) for s in sims]
        if args.router_core is not None:
            _pin(args.router_core, router_ps, sim_ps)  # (this process sleeps through the window)
        time.sleep(args.warmup)
        t0, cpu0, sim_cpu0 = time.perf_counter(), _cpu(router_ps), sum(map(_cpu, sim_ps))
        main0, rows0 = _main_thread_cpu(router_ps), len(_router_rows(run_dir))
        while time.perf_counter() < t0 + args.seconds:
            if router.poll() is not None:
                raise RuntimeError(f"the router exited ({router.returncode}):\n{_log_tail(run_dir)}")
            time.sleep(min(0.2, max(0.0, t0 + args.seconds - time.perf_counter())))
        t1, cpu1, sim_cpu1 = time.perf_counter(), _cpu(router_ps), sum(map(_cpu, sim_ps))
        main1 = _main_thread_cpu(router_ps)
        rows = _router_rows(run_dir)[rows0:]  # the iterations whose row the router wrote in the window
        rss = router_ps.memory_info().rss
        router_on = _cores_of(router_ps)
        warnings = _log_warnings(run_dir)  # (until the window's end: the teardown's are not the run's)
        stop.set()
        reports = take("report", time.monotonic() + JOIN_TIMEOUT_S)
    finally:
        stop.set()
        for sim in sims:
            sim.join(timeout=5)
            if sim.is_alive():
                sim.kill()
                sim.join(timeout=5)
        if router.poll() is None and args.profile:  # (SIGTERM: the router stops, and cProfile writes)
            router.terminate()
            try:
                router.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if router.poll() is None:
            router.kill()
        router.wait(timeout=10)
    figures = _figures(args, plan, reports, t0, t1, (cpu1 - cpu0, main1 - main0), sim_cpu1 - sim_cpu0, rss)
    figures["router_warnings"] = warnings
    figures["router_on_cores"] = router_on
    figures.update(router_lag(rows))
    return figures


def _router_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The router's metrics rows so far (one per iteration), the last line left out if not yet whole."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def router_lag(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How late the router's own loop ran (router/loop_lag.py) in the window's rows: over all their ticks, the
    p99's upper bound (`pooled_percentile`; None past the largest of `OVER_MS`) and the share of the ticks over
    each of `OVER_MS`; the worst row's p99 (of that row's ticks alone) and the most, the rows' median p50 and
    each row's p99, over `router_lag_rows` rows; the same of the part of the lag that was the router's own
    work; NaN with no row in the window."""
    lagged = [r for r in rows if "router/loop_lag_p99_ms" in r]
    ticks = sum(r[MetricKeys.LOOP_LAG_TICKS] for r in lagged)
    return {
        "router_lag_rows": len(lagged),
        "router_lag_ticks": ticks,
        "router_lag_p99_bound_ms": pooled_percentile(lagged, 99),
        "router_work_lag_p99_bound_ms": pooled_percentile(lagged, 99, work=True),
        **{
            f"router_{kind}_share_over_ms": {
                f"{ms:g}": sum(r[MetricKeys.loop_lag_over(ms, kind == "work_lag")] for r in lagged) / ticks
                if ticks
                else None
                for ms in OVER_MS
            }
            for kind in ("lag", "work_lag")
        },
        "router_lag_p50_ms": float(np.median([r["router/loop_lag_p50_ms"] for r in lagged]))
        if lagged
        else float("nan"),
        "router_lag_p99s_ms": [r["router/loop_lag_p99_ms"] for r in lagged],
        "router_lag_p99_ms": max((r["router/loop_lag_p99_ms"] for r in lagged), default=float("nan")),
        "router_lag_max_ms": max((r["router/loop_lag_max_ms"] for r in lagged), default=float("nan")),
        "router_work_lag_p99_ms": max((r["router/loop_work_lag_p99_ms"] for r in lagged), default=float("nan")),
        "router_work_lag_max_ms": max((r["router/loop_work_lag_max_ms"] for r in lagged), default=float("nan")),
    }


def _wait_bound(endpoint: str, router: subprocess.Popen, run_dir: Path, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Wait until the router listens at `endpoint`, within `timeout_s`. Its sockets are looked at, not
    connected to: a probe's connection would be a ZeroMQ handshake the router refuses and logs."""
    import psutil

    port = int(endpoint.rsplit(":", 1)[1])
    deadline = time.monotonic() + timeout_s
    while True:
        if router.poll() is not None:
            raise RuntimeError(f"the router exited ({router.returncode}):\n{_log_tail(run_dir)}")
        with contextlib.suppress(psutil.NoSuchProcess):
            sockets = psutil.Process(router.pid).net_connections("tcp")
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in sockets):
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router did not listen at {endpoint} within {timeout_s:g}s")
        time.sleep(0.05)


def _log_warnings(run_dir: Path) -> list[str]:
    """The router log's WARNING and ERROR lines so far, the time stamps left out (it logs at WARNING here)."""
    log = run_dir / "logs" / "router.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [line.split(" ", 2)[-1] for line in lines if " WARNING [" in line or " ERROR [" in line]


def _log_tail(run_dir: Path) -> str:
    log = run_dir / "logs" / "router.log"
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""


def _figures(
    args: argparse.Namespace,
    plan: dict[str, Any],
    reports: dict[int, dict[str, Any]],
    t0: float,
    t1: float,
    router_cpus: tuple[float, float],
    sim_cpu: float,
    rss: int,
) -> dict[str, Any]:
    """The point's figures from the simulators' records over the window [t0, t1]; `router_cpus`: the router
    process's CPU seconds in the window, and its main thread's."""
    window = t1 - t0
    router_cpu, main_cpu = router_cpus
    served = {(origin, rid): s for r in reports.values() for origin, rid, s, _ in r["served"]}
    straight = [direct for r in reports.values() for *_, direct in r["served"]]
    requests = [q for r in reports.values() for q in r["requests"]]
    answered = sum(1 for _, _, _, done in requests if t0 <= done < t1)
    added, e2e, service = [], [], []
    for origin, rid, sent, done in requests:
        if t0 <= sent < t1 and (origin, rid) in served:
            s = served[(origin, rid)]
            e2e.append(done - sent)
            service.append(s)
            added.append(done - sent - s)
    samples = sum(n for r in reports.values() for at, n in r["samples"] if t0 <= at < t1)
    episodes = sum(1 for r in reports.values() for at in r["episodes"] if t0 <= at < t1)
    lag = [v for r in reports.values() for at, v in r["lag"] if t0 <= at < t1]
    queued = [v for r in reports.values() for at, v in r["queued"] if t0 <= at < t1]
    rps = answered / window
    added_ms = np.array(added) * 1000
    return {
        **{k: v for k, v in plan.items() if k != "capacities"},
        "window_s": window,
        "requests": answered,
        "rps": rps,
        "direct_fraction": sum(straight) / len(straight) if straight else float("nan"),
        "router_cpu_s": router_cpu,
        "router_cores": router_cpu / window,
        "router_cpu_us_per_request": router_cpu / answered * 1e6 if answered else float("nan"),
        "router_main_us_per_request": main_cpu / answered * 1e6 if answered else float("nan"),
        "sim_cores": sim_cpu / window,
        "added_p50_ms": _percentile(added_ms, 50),
        "added_p99_ms": _percentile(added_ms, 99),
        "added_mean_ms": float(added_ms.mean()) if len(added_ms) else float("nan"),
        "e2e_p50_ms": _percentile(np.array(e2e) * 1000, 50),
        "service_p50_ms": _percentile(np.array(service) * 1000, 50),
        "in_transit": rps * float(added_ms.mean()) / 1000 if len(added_ms) else float("nan"),
        "replica_queue_max": max(queued, default=0),
        "router_rss_mb": rss / 2**20,
        "samples_per_s": samples / window,
        "episodes_per_s": episodes / window,
        "router_cpu_us_per_episode": router_cpu / episodes * 1e6 if episodes else float("nan"),
        "sim_lag_p99_ms": _percentile(np.array(lag) * 1000, 99),
        "errors": sum(r["errors"] for r in reports.values()),
        "sample_mismatches": sum(r["mismatches"] for r in reports.values()),
        **{f"groups_{key}": sum(r["groups"].get(key, 0) for r in reports.values()) for key in GROUP_COUNTS},
        "steps": sum(r["steps"] for r in reports.values()),
        "shutdown": [r["shutdown"] for r in reports.values() if r["shutdown"]],
    }


# ---- the sweep's summary ------------------------------------------------------------------------------


def saturation(points: list[dict[str, Any]], bound_ms: float) -> dict[str, Any]:
    """Over one replica count's points (by offered load): the knee, the first point where requests/s stops
    growing with the offered load (achieved/offered below 0.85 of the best point's ratio), the most
    requests/s measured, the most whose p99 added latency is within the bound, and the router's CPU per
    request at the point of most requests/s (all of its CPU over the window, heartbeats and episodes
    included, per request answered: at a higher rate the per-peer part spreads over more requests, so
    scaling it linearly errs on the high side)."""
    points = sorted(points, key=lambda p: p["offered_rps"])
    best_ratio = max(p["rps"] / p["offered_rps"] for p in points)
    knee = next((p for p in points if p["rps"] / p["offered_rps"] < 0.85 * best_ratio), None)
    top = max(points, key=lambda p: p["rps"])
    result: dict[str, Any] = {
        "saturated": knee is not None,
        "max_rps": top["rps"],
        "max_rps_within_p99_bound": max((p["rps"] for p in points if p["added_p99_ms"] <= bound_ms), default=0.0),
        "cpu_us_per_request": top["router_cpu_us_per_request"],
        "router_cores_at_max": top["router_cores"],
    }
    if knee is not None:
        result["knee_offered_rps"] = knee["offered_rps"]
        result["knee_rps"] = knee["rps"]
        result["router_cores_at_knee"] = knee["router_cores"]
        result["bottleneck"] = "router" if knee["router_cores"] >= 0.85 else "the simulator or the machine"
    return result


def core_calibration() -> float:
    """Seconds of a fixed pure-Python workload (loops, integer arithmetic, dict stores) on one core."""
    start = time.perf_counter()
    table: dict[int, int] = {}
    total = 0
    for i in range(1_000_000):
        total += i * i % 7
        table[i & 1023] = total
    return time.perf_counter() - start


def load_unit(args: argparse.Namespace) -> tuple[str, str]:
    """What the router's load is counted in, and the point's key for it: episodes with leases and Groups straight
    to the trainers (it sees no request then, and an episode's messages do not grow with its turns), else
    requests."""
    return ("episode", "episodes_per_s") if args.leases and not args.routed_groups else ("request", "rps")


def cpu_fit(points: list[dict[str, Any]], key: str = "rps") -> tuple[float, float] | str:
    """The router's cores against its load (`key`: requests/s or episodes/s) over `points` (one replica count,
    several loads) as a line: (fixed cores, marginal CPU seconds per unit of load), least squares; or why there
    is none: fewer than 2 distinct loads, iterations of different sizes (an iteration's costs, the weight-update
    notice to every replica among them, would grow with the rate in the deployment but not across such loads,
    and read as fixed), or a line that is not a fixed cost plus a cost per unit (a negative term: too noisy)."""
    if len({round(p[key]) for p in points}) < 2:
        return "one load"
    if len({p["batch_size"] for p in points}) > 1:
        return "loads with iterations of different sizes: --iteration-episodes"
    marginal, fixed = np.polyfit([p[key] for p in points], [p["router_cores"] for p in points], 1)
    return (float(fixed), float(marginal)) if fixed >= 0 and marginal > 0 else "a negative fixed or marginal cost"


def deployment_check(args: argparse.Namespace, points: list[dict[str, Any]], sat: dict[int, dict]) -> dict[str, Any]:
    """Whether one router keeps up with `--gpus` GPUs, at the replica count nearest the deployment's replicas and
    in the router's unit of load (`load_unit`; in episodes, the deployment's requests/s over
    `--deployment-turns`): its cores measured at a point of at least the deployment's load where there is one
    (the nearest above), else from the line through the loads (`cpu_fit`: fixed costs, heartbeats to every peer
    among them, do not grow with the load), else the load times the CPU per unit measured at the most load (an
    upper bound: the fixed costs counted per unit)."""
    rate = deployment_rate(args.gpus, args.tokens_per_s_per_gpu, args.tokens_per_turn, args.k)
    unit, key = load_unit(args)
    turns = args.deployment_turns or args.turns
    load = rate / turns if unit == "episode" else rate
    replicas = max(1, args.gpus // args.gpus_per_replica)
    nearest = min(sat, key=lambda c: abs(math.log(c / replicas)))
    mine = [p for p in points if p["replicas"] == nearest]
    top = max(mine, key=lambda p: p[key])
    per_unit = top["router_cores"] / top[key] if top[key] else float("inf")
    fit = cpu_fit(mine, key)
    fixed, marginal = fit if isinstance(fit, tuple) else (0.0, per_unit)
    at = min((p for p in mine if p[key] >= load), key=lambda p: p[key], default=None)
    cores = at["router_cores"] if at is not None else fixed + marginal * load
    per_gpu = args.tokens_per_s_per_gpu / (args.tokens_per_turn * args.k) / (turns if unit == "episode" else 1)
    near_rate = [p for p in mine if p["rps"] >= 0.9 * rate]
    return {
        "gpus": args.gpus,
        "replicas": replicas,
        "measured_replicas": nearest,
        "rate_rps": rate,
        "formula": "requests/s = GPUs * tokens_per_s_per_gpu / (tokens_per_turn * K)",
        "unit": unit,
        "deployment_turns": turns,
        "load": load,
        "max_load_measured": top[key],
        "cpu_us_per_unit": per_unit * 1e6,
        "cores_per_unit_bound": per_unit * load,
        "fit_loads": len(mine) if isinstance(fit, tuple) else 0,
        "no_fit": None if isinstance(fit, tuple) else fit,
        "fixed_cores": fixed if isinstance(fit, tuple) else None,
        "marginal_us_per_unit": marginal * 1e6 if isinstance(fit, tuple) else None,
        "cores_from_line": fixed + marginal * load if isinstance(fit, tuple) else None,
        "measured_at_load": at[key] if at is not None else None,
        "router_cores": cores,
        "cpu_target_met": cores <= args.cpu_target,
        "keeps_up": cores < 1.0,
        "margin": 1.0 / cores if cores > 0 else float("inf"),
        "max_gpus_at_target": gpus_within(args.cpu_target, fixed, marginal * per_gpu),
        "max_gpus_one_core": gpus_within(1.0, fixed, marginal * per_gpu),
        "p99_at_rate_ms": min(p["added_p99_ms"] for p in near_rate) if near_rate else None,
        **_lag_at(at if at is not None else top, key),
        "max_rps_measured": sat[nearest]["max_rps"],
    }


def gpus_within(cores: float, fixed: float, per_gpu: float) -> int | None:
    """The most GPUs whose load fits in `cores` at `fixed` cores plus `per_gpu` cores per GPU; None with no cost
    per GPU measured (no load in the window)."""
    if not 0 < per_gpu < math.inf:
        return None
    return max(0, int((cores - fixed) / per_gpu))


def _lag_at(p: dict[str, Any], key: str) -> dict[str, Any]:
    """The router's loop lag at point `p` (None where no row of the router's fell in its window), and its load."""
    keys = (
        "router_lag_p99_bound_ms", "router_work_lag_p99_bound_ms", "router_lag_ticks", "router_lag_share_over_ms",
        "router_work_lag_share_over_ms", "router_lag_p99_ms", "router_lag_max_ms", "router_work_lag_p99_ms",
        "router_work_lag_max_ms", "router_lag_rows",
    )  # fmt: skip
    lagged = p["router_lag_rows"] > 0
    return {**{k: p[k] if lagged else None for k in keys}, "router_lag_at_load": p[key]}


def cpu_line(args: argparse.Namespace, check: dict[str, Any]) -> str:
    """The deployment check's line on the router's CPU at the deployment's load."""
    unit, load = check["unit"], check["load"]
    bound = (
        f"{check['cpu_us_per_unit']:.0f} us/{unit} at the most {unit}s/s measured ({check['max_load_measured']:.0f}) "
        f"x {load:.0f} {unit}s/s = {check['cores_per_unit_bound']:.2f} cores, the fixed costs counted per {unit}"
    )
    line = (
        f"{check['fixed_cores']:.3f} cores fixed + {check['marginal_us_per_unit']:.1f} us/{unit} (the line through "
        f"the {check['fit_loads']} loads measured with {check['measured_replicas']} replicas, up to "
        f"{check['max_load_measured']:.0f} {unit}s/s) x {load:.0f} {unit}s/s = {check['cores_from_line']:.2f} cores"
        if check["fixed_cores"] is not None
        else None
    )
    if check["measured_at_load"] is not None:
        how = (
            f"measured at {check['measured_at_load']:.0f} {unit}s/s ({check['measured_replicas']} replicas, "
            f"episodes of {args.turns} turn{'s' if args.turns != 1 else ''}): {check['router_cores']:.2f} cores"
        )
        others = f" (the line through the loads: {line})" if line else ""
    elif line is not None:
        how, others = line, f" (at most {bound})"
    else:
        how, others = f"{bound} (an upper bound: no line through the loads, {check['no_fit']})", ""
    return (
        f"router CPU there: {how}{others}; target <= {args.cpu_target:g}: "
        f"{'met' if check['cpu_target_met'] else 'NOT met'}; "
        f"{'keeps up' if check['keeps_up'] else 'does NOT keep up'} (margin {check['margin']:.2f}x of one core)"
    )


def _bound(ms: float | None) -> str:
    """A pooled percentile's bound as the table and the check print it: '<=3', or '>10' past `OVER_MS`."""
    return f"<={ms:g}" if ms is not None else f">{OVER_MS[-1]:g}"


def _lag(p: dict[str, Any]) -> str:
    """A point's router loop lag at p99 over the window's ticks, 'all/its own work' ms, or '-' with no row of
    the router's in its window."""
    if not p["router_lag_ticks"]:
        return "-"
    return f"{_bound(p['router_lag_p99_bound_ms'])}/{_bound(p['router_work_lag_p99_bound_ms'])}"


def own_delay(args: argparse.Namespace, check: dict[str, Any]) -> str:
    """The deployment check's line on the router's own delay: its loop's lag at p99 over the window's ticks,
    judged against `--p99-bound-ms` on the whole lag when the router has a core of its own (`--router-core`),
    else on its own work (the rest being the simulators' CPU on the shared cores)."""
    alone = args.router_core is not None
    bound = check["router_lag_p99_bound_ms" if alone else "router_work_lag_p99_bound_ms"]
    verdict = "met" if bound is not None and bound <= args.p99_bound_ms else "NOT met"
    over = check["router_lag_share_over_ms" if alone else "router_work_lag_share_over_ms"].get(f"{args.p99_bound_ms:g}")
    share = "" if over is None else f"; {over:.2%} of the ticks over {args.p99_bound_ms:g} ms"
    where = f"on core {args.router_core} alone" if alone else "on the shared cores"
    line = (
        f"the router's own delay (at {check['router_lag_at_load']:.0f} {check['unit']}s/s, {where}): its loop ran "
        f"{_bound(check['router_lag_p99_bound_ms'])} ms late at p99 over the window's {check['router_lag_ticks']} ticks"
    )
    if alone:
        line += f" (all of it the router's own: its loop and libzmq's threads{share})"
    else:
        line += (
            f", of which its own work {_bound(check['router_work_lag_p99_bound_ms'])} ms{share} (the rest the "
            f"simulators' CPU on the shared cores)"
        )
    return (
        f"{line}; what every message it handles waits. The worst of the {check['router_lag_rows']} iteration rows: "
        f"p99 {check['router_lag_p99_ms']:.2f} ms of its own ticks, own work {check['router_work_lag_p99_ms']:.2f} ms; "
        f"at most {check['router_lag_max_ms']:.2f} ms (own work {check['router_work_lag_max_ms']:.2f} ms). Target <= "
        f"{args.p99_bound_ms:g} ms at p99{'' if alone else ', its own work'}: {verdict}"
        + (" (with leases no request passes through the router)" if args.leases else "")
    )


def groups_note(p: dict[str, Any]) -> str:
    """With leases: where the point's Groups went over the run, what the trainer made of the straight ones, and
    the router's CPU per episode done in the window."""
    note = f"  groups: {p['groups_via_router']} via the router, {p['groups_straight']} straight"
    if p["groups_straight"] or p["groups_accepted"]:
        note += f" ({p['groups_delivered']} of {p['groups_accepted']} accepted delivered)"
    problems = [f"{p[f'groups_{key}']} {key}" for key in ("missing", "unaccepted", "refused") if p[f"groups_{key}"]]
    if problems:
        note += f" ({', '.join(problems)})"
    if p["episodes_per_s"]:
        note += f"; router {p['router_cpu_us_per_episode']:.0f} us/episode"
    return note


def report(args: argparse.Namespace, points: list[dict[str, Any]], calibration_s: float) -> dict[str, Any]:
    leases = (
        "off: Generate and Groups through the router"
        if not args.leases
        else "on: Generate straight to the replicas, Groups "
        + ("through the router (--routed-groups)" if args.routed_groups else "straight to the trainer")
    )
    print(
        f"scale: K={args.k}, prompt {args.prompt_tokens} tokens, {args.tokens_per_turn} tokens/turn, {args.turns} turns, "
        f"env step lognormal median {args.env_step_ms:g} ms sigma {args.env_step_sigma:g}; service "
        f"{service_s(args) * 1000:.0f} ms/request (B={args.batch}, {args.tokens_per_s_per_gpu:g} tokens/s/GPU); cycle "
        f"{cycle_s(args) * 1000:.0f} ms; staleness {args.staleness}; CURVE {'on' if args.curve else 'off'}; "
        f"leases {leases}; heartbeats every {args.heartbeat_s:g} s or processes / 500 s where longer; "
        f"{args.procs} simulator processes; window {args.seconds:g} s after {args.warmup:g} s"
        + ("" if args.router_core is None else f"; the router alone on core {args.router_core}")
    )
    head = (
        f"{'replicas':>8} {'offered':>8} {'episodes':>8} {'req/s':>8} {'us/req':>7} {'loop us':>7} {'router':>6} {'sims':>5} "
        f"{'p50 ms':>7} {'p99 ms':>7} {'transit':>7} {'RSS MB':>7} {'samples/s':>9} {'lag p99':>7} {'router lag':>10}"
    )
    print(head)
    for p in points:
        print(
            f"{p['replicas']:>8} {p['offered_rps']:>8.0f} {p['episodes']:>8} {p['rps']:>8.0f} "
            f"{p['router_cpu_us_per_request']:>7.1f} {p['router_main_us_per_request']:>7.1f} {p['router_cores']:>6.2f} "
            f"{p['sim_cores']:>5.2f} "
            f"{p['added_p50_ms']:>7.2f} {p['added_p99_ms']:>7.2f} {p['in_transit']:>7.1f} {p['router_rss_mb']:>7.0f} "
            f"{p['samples_per_s']:>9.0f} {p['sim_lag_p99_ms']:>7.2f} {_lag(p):>10}"
            + (f"  {p['direct_fraction']:.0%} straight" if p["direct_fraction"] < 1 and args.leases else "")
            + (f"  errors {p['errors']}" if p["errors"] else "")
            + (f"  sample mismatches {p['sample_mismatches']}" if p["sample_mismatches"] else "")
            + (groups_note(p) if args.leases else "")
            + (f"  router warnings {len(p['router_warnings'])}" if p["router_warnings"] else "")
        )
    print(
        "(us/req: the router process's CPU per request; loop us: its main thread's, the rest being libzmq's I/O "
        "threads (CURVE, TCP); router: its cores over the window; sims: the simulators' cores; p50/p99: latency added per request, "
        "end-to-end minus the replica's service time, the simulators' loop lag included; transit: requests "
        "in transit, Little's law; lag p99: the simulators' loop lag; router lag: how late the router's "
        "loop ran, what every message waits before the router handles it, p99 over the window's ticks (a bound: "
        "router/loop_lag.py's OVER_MS): all / the router's own work)"
    )
    sat: dict[int, dict[str, Any]] = {}
    for count in sorted({p["replicas"] for p in points}):
        sat[count] = s = saturation([p for p in points if p["replicas"] == count], args.p99_bound_ms)
        knee = (
            f"requests/s stops growing at offered {s['knee_offered_rps']:.0f} (achieved {s['knee_rps']:.0f}, the "
            f"router at {s['router_cores_at_knee']:.2f} cores: bound by {s['bottleneck']})"
            if s["saturated"]
            else "requests/s grew with every offered load"
        )
        print(
            f"{count} replicas: {knee}; the most measured: {s['max_rps']:.0f} req/s (router {s['cpu_us_per_request']:.0f}"
            f" us/request, {s['router_cores_at_max']:.2f} cores); the most within p99 <= {args.p99_bound_ms:g} ms: "
            f"{s['max_rps_within_p99_bound']:.0f} req/s"
        )
    check = deployment_check(args, points, sat)
    print(
        f"deployment: {args.gpus} GPUs x {args.tokens_per_s_per_gpu:g} tokens/s / ({args.tokens_per_turn} tokens/turn "
        f"x K={args.k}) = {check['rate_rps']:.0f} requests/s ({check['formula']})"
    )
    if check["unit"] == "episode":
        print(
            f"  with leases and Groups straight to the trainers the router sees episodes, not requests: "
            f"{check['rate_rps']:.0f} requests/s in episodes of {check['deployment_turns']} turns are "
            f"{check['load']:.0f} episodes/s"
        )
    print("  " + cpu_line(args, check))
    print(
        f"  one core here is taken as one server core (this machine: {calibration_s * 1000:.0f} ms for the fixed "
        f"pure-Python workload, `core_calibration`)"
    )
    if check["p99_at_rate_ms"] is not None:
        verdict = "met" if check["p99_at_rate_ms"] <= args.p99_bound_ms else "NOT met"
        print(f"  p99 added latency at that rate: {check['p99_at_rate_ms']:.2f} ms (target <= "
              f"{args.p99_bound_ms:g} ms: {verdict})")  # fmt: skip
    else:
        print(
            f"  p99 added latency at that rate: not measured here (the most requests/s reached with "
            f"{check['measured_replicas']} replicas: {check['max_rps_measured']:.0f})"
        )
    if check["router_lag_ticks"]:
        print("  " + own_delay(args, check))
    print(
        f"  largest deployment of one router ({args.tokens_per_s_per_gpu:g} tokens/s/GPU, {args.tokens_per_turn} "
        f"tokens/turn, K={args.k}"
        + (f", {check['deployment_turns']} turns an episode" if check["unit"] == "episode" else "")
        + (
            f"): {check['max_gpus_at_target']} GPUs at <= {args.cpu_target:g} core, {check['max_gpus_one_core']} GPUs "
            f"at one full core"
            if check["max_gpus_one_core"] is not None
            else "): not measured (no load in the window)"
        )
    )
    return {"saturation": {str(k): v for k, v in sat.items()}, "deployment": check}


def plot(points: list[dict[str, Any]], path: Path, bound_ms: float, cpu_target: float, alone: bool = False) -> None:
    """Requests/s, the end-to-end added p99, the router's loop lag p99 (with `alone`, the router on a core of its
    own: all of it; else the part that was its own work) and its cores, against the offered load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    for count in sorted({p["replicas"] for p in points}):
        mine = sorted((p for p in points if p["replicas"] == count), key=lambda p: p["offered_rps"])
        x = [p["offered_rps"] for p in mine]
        label = f"{count} replicas"
        axes[0].plot(x, [p["rps"] for p in mine], "o-", label=label)
        axes[1].plot(x, [p["added_p99_ms"] for p in mine], "o-", label=label)
        key = "router_lag_p99_bound_ms" if alone else "router_work_lag_p99_bound_ms"
        ceiling = OVER_MS[-1] * 1.05  # (a p99 past the largest of OVER_MS is drawn at the top of the panel)
        lag = [(ceiling if p[key] is None else p[key]) if p["router_lag_ticks"] else math.nan for p in mine]
        axes[2].plot(x, lag, "o-", label=label)
        axes[3].plot(x, [p["router_cores"] for p in mine], "o-", label=label)
    top = max(p["offered_rps"] for p in points)
    axes[0].plot([0, top], [0, top], ":", color="grey", label="offered")
    for ax in axes[1:3]:
        ax.axhline(bound_ms, ls="--", color="red", label=f"{bound_ms:g} ms bound")
    axes[3].axhline(cpu_target, ls="--", color="red", label=f"{cpu_target:g} core target")
    titles = (
        "requests/s",
        "added latency p99, end to end (ms)",
        "router's loop lag p99 (ms, at most)" if alone else "router's loop lag p99, its own work (ms, at most)",
        "router CPU (cores)",
    )
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xlabel("offered load (requests/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[2].set_ylim(0, max(bound_ms, OVER_MS[-1]) * 1.1)
    axes[1].set_yscale("log")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[64, 256, 1024], help="replica counts swept")
    p.add_argument("--episodes", type=int, nargs="+", default=[256, 1024, 2048, 4096],
                   help="concurrent episodes swept: the offered load is episodes / cycle requests/s")  # fmt: skip
    p.add_argument("--k", type=int, default=4, help="candidates per request (n)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--tokens-per-turn", type=int, default=100, help="tokens per completion")
    p.add_argument("--tokens-per-s-per-gpu", type=float, default=3000.0, help="a GPU's decode rate at full batch")
    p.add_argument("--gpus-per-replica", type=int, default=1)
    p.add_argument("--batch", type=int, default=4, help="B: requests a replica decodes at once, at full rate")
    p.add_argument("--turns", type=int, default=4, help="T: turns per episode (one Generate each)")
    p.add_argument("--env-step-ms", type=float, default=50.0, help="median env step (lognormal)")
    p.add_argument("--env-step-sigma", type=float, default=0.5, help="sigma of the env step's lognormal")
    p.add_argument("--episodes-per-worker", type=int, default=64, help="C: concurrent episodes per env worker")
    p.add_argument("--staleness", type=int, default=1, help="rollout.max_staleness of the simulated run")
    p.add_argument(
        "--iteration-episodes", type=int,
        help="episodes per iteration (rollout.batch_size) at every point; by default half of each point's concurrent "
        "episodes (with --staleness 1). The deployment check reads the router's CPU as a line through the loads only "
        "where their iterations are of one size",
    )  # fmt: skip
    p.add_argument("--step-ms", type=float, default=100.0, help="the simulated trainer's step")
    p.add_argument("--procs", type=int, default=2, help="simulator processes the peers are packed into")
    p.add_argument("--curve", action=argparse.BooleanOptionalAction, default=True, help="CURVE on every socket")
    p.add_argument(
        "--leases", action=argparse.BooleanOptionalAction, default=True,
        help="cluster.leases: env workers send Generate straight to the replicas the router leases them",
    )  # fmt: skip
    p.add_argument(
        "--routed-groups", action="store_true",
        help="with leases, env workers send their Groups through the router (its fallback for a worker with no "
        "trainer link), not straight to the trainer",
    )  # fmt: skip
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="cluster.heartbeat_s, of the router and the peers")
    p.add_argument(
        "--router-core", type=int,
        help="run the router on this core alone and everything else on the others (as on a server, where the "
        "router has a core of its own): its loop's lag is then its own delay",
    )  # fmt: skip
    p.add_argument("--warmup", type=float, default=3.0, help="seconds after every peer joined, before counting")
    p.add_argument("--seconds", type=float, default=6.0, help="the measured window per point")
    p.add_argument("--gpus", type=int, default=1024, help="the deployment checked")
    p.add_argument(
        "--deployment-turns", type=int,
        help="turns per episode of the deployment checked (default: --turns): its requests/s in episodes/s, the "
        "router's load with leases",
    )  # fmt: skip
    p.add_argument("--p99-bound-ms", type=float, default=5.0, help="added latency target, p99")
    p.add_argument("--cpu-target", type=float, default=0.5, help="router CPU target, cores")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    p.add_argument("--plot", type=Path, help="draw requests/s, p99 added latency and router CPU against load")
    p.add_argument("--profile", type=Path, help="run the router under cProfile, writing its stats here (one point)")
    p.add_argument("--smoke", action="store_true", help="a tiny run (seconds), for the tests")
    args = p.parse_args(argv)
    if args.deployment_turns is not None and args.deployment_turns < 1:
        p.error(f"--deployment-turns must be at least 1, got {args.deployment_turns}")
    if args.iteration_episodes is not None and args.iteration_episodes < 1:
        p.error(f"--iteration-episodes must be at least 1, got {args.iteration_episodes}")
    if args.smoke:
        args.replicas, args.episodes, args.turns, args.procs = [6], [8, 16], 2, 2
        args.episodes_per_worker, args.warmup, args.seconds = 8, 1.0, 2.0
        args.batch, args.step_ms = 1, 20.0  # 133 ms per request
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The router and the simulators run the code this process runs (another checkout may be installed
    # meanwhile: its config keys would differ).
    code = str(Path(mas_async.__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (code, os.environ.get("PYTHONPATH")) if p)
    calibration_s = core_calibration()
    points = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mas-async-bench-scale-") as tmp:
        for replicas in args.replicas:
            for episodes in args.episodes:
                point = measure_point(args, replicas, episodes, Path(tmp) / f"r{replicas}-e{episodes}")
                points.append(point)
                print(
                    f"  [{time.monotonic() - started:.0f}s] {replicas} replicas, offered {point['offered_rps']:.0f}: "
                    f"{point['rps']:.0f} req/s, p99 {point['added_p99_ms']:.2f} ms, router {point['router_cores']:.2f} "
                    f"cores",
                    flush=True,
                )
    summary = report(args, points, calibration_s)
    if args.plot:
        plot(points, args.plot, args.p99_bound_ms, args.cpu_target, alone=args.router_core is not None)
        print(f"plot: {args.plot}")
    if args.json:
        result = {
            "bench": "scale",
            "date": datetime.now().isoformat(timespec="seconds"),
            "args": vars(args),
            "service_ms": service_s(args) * 1000,
            "cycle_ms": cycle_s(args) * 1000,
            "core_calibration_s": calibration_s,
            "points": points,
            **summary,
        }
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
