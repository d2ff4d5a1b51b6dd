"""The scale bench's simulated peers (bench/scale.py): every process of a deployment but the router, as asyncio
callbacks and tasks on uvloop in a few simulator processes, one DEALER socket per simulated peer, each joining with
a Hello as the real peers do; and the ping peer, a process of its own that measures the router's round trip.

What each simulated peer does is in bench/scale.py's docstring; what they record (the requests, their service
times, the samples and episodes, the message delays) is read by `bench/scale_sweep.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from mas_async.peer_names import trainer_peer
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
            self.sim.loaded.append((msg.version, time.perf_counter()))  # type: ignore[attr-defined]
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
        self.freed: deque[float] = deque()
        """When each EpisodeDone not yet followed by a RunEpisode was due (oldest first): a slot to refill."""

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
                future.set_result(time.perf_counter())
        elif kind == Kind.RUN_EPISODE:
            msg = decode([f.buffer for f in frames])
            self.dispatched(msg.iteration)  # type: ignore[attr-defined]
            task = self.sim.loop.create_task(self.episode(msg))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def dispatched(self, iteration: int) -> None:
        """A RunEpisode arrived: it refills the slot of this worker's oldest EpisodeDone still unanswered, and that
        delay is the router's when the episode's iteration was already open (a RunEpisode of it had reached this
        simulator) when the EpisodeDone was due: the router had work to give, and gave it on that EpisodeDone.
        Otherwise the slot waited for an iteration to open (a step), which is not a delay of the router's."""
        now = time.perf_counter()
        opened = self.sim.opened.setdefault(iteration, now)
        if self.freed:
            due = self.freed.popleft()
            self.sim.dispatches.append((due, now, opened < due))

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

    async def send_groups(self, msg: Any, frames: list) -> float | None:
        """An episode's Groups: straight to the trainer rank its RunEpisode names (rank 0 when it names none)
        when linked to it, returning once the trainer answered (a real worker sends its EpisodeDone only
        then; no answer within `GROUPS_WAIT_S` is counted as an error) with when the answer came, else
        through the router (None)."""
        link = self.trainers.get(trainer_peer(POLICY, msg.trainer_ranks.get(POLICY, 0)))
        if link is None:
            self.link.send(frames)
            self.sim.groups["via_router"] += 1
            return None
        key = (msg.iteration, msg.episode_id, msg.attempt)
        answer = self.received[key] = self.sim.loop.create_future()
        link.send(frames)
        self.sim.groups["straight"] += 1
        try:
            return await asyncio.wait_for(answer, GROUPS_WAIT_S)
        except TimeoutError:
            self.sim.errors += 1
            return None
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
        due = time.perf_counter()  # when the EpisodeDone is due: the last env step's end, or the trainer's answer
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
                step = self.rng.lognormvariate(spec["env_step_mu"], spec["env_step_sigma"])
                due = time.perf_counter() + step
                await asyncio.sleep(step)
        except TimeoutError:
            error = f"a request timed out after {REQUEST_TIMEOUT_S}s"
            sim.errors += 1
            due = time.perf_counter()
        samples = {}
        if not error:
            n, tokens = spec["samples"], spec["sample_tokens"]
            header = pack([POLICY, msg.iteration, msg.episode_id, msg.attempt, n, tokens])
            answered = await self.send_groups(msg, [GROUPS, header, sim.groups_payload])
            due = answered if answered is not None else due
            samples = {POLICY: n}
        summary = {"success": 0.0, "turns": spec["turns"], "tokens": spec["sample_tokens"]}
        done = EpisodeDone(msg.episode_id, msg.iteration, msg.mode, msg.attempt, error, summary, samples)
        self.link.send(encode(done))
        self.freed.append(due)
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
        due = time.perf_counter() + self.step_s
        await asyncio.sleep(self.step_s)
        version = msg.version + 1
        self.sim.updates.append((version, due))
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
        self.opened: dict[int, float] = {}
        """Iteration -> when its first RunEpisode reached this simulator."""
        self.dispatches: list[tuple[float, float, bool]] = []
        """(EpisodeDone due, the worker's next RunEpisode received, whether that delay was the router's)."""
        self.updates: list[tuple[int, float]] = []
        """(version, when the trainer's UpdateWeights was due: its step's end)."""
        self.loaded: list[tuple[int, float]] = []
        """(version, when a replica of this simulator took its UpdateWeights and answered WeightsLoaded)."""
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

    async def run(self, ready: Callable[[], None]) -> dict[str, Any]:
        """Run the peers until the parent says stop; `ready()` once every one of them was welcomed."""
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
        ready()
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
            "dispatches": self.dispatches,
            "updates": self.updates,
            "loaded": self.loaded,
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
        return await Sim(spec, stop).run(lambda: spec["out"].put(("ready", spec["index"], None)))

    try:
        report = uvloop.run(main())
    except BaseException as e:
        spec["out"].put(("failed", spec["index"], f"{type(e).__name__}: {e}"))
        raise
    spec["out"].put(("report", spec["index"], report))


# ---- the ping peer ------------------------------------------------------------------------------------


PING_POLICY = "ping"
"""The policy a ping names: no replica serves it, so the router answers each ping at once (a GenerateResult with
an error), through its whole receive, dispatch and send path."""


def ping_process(spec: dict[str, Any], stop: Any) -> None:
    """A paced prober of the router in a process of its own (so its own loop is idle and on time): one more env
    worker of the run, of capacity 0 (no episode is dispatched to it), that sends a Generate for `PING_POLICY`
    every `ping_s` seconds and records, for each, when it was due (its place in the pace, not when it actually
    went: a late loop does not hide a slow router, no coordinated omission) and when the router's answer came.
    Beside it, in the same process and on the same idle loop, the probe worker (`spec["probe"]`, a `Sim` of one
    env worker, run as the simulators run theirs): its EpisodeDone to its next RunEpisode is the router's delay,
    not a saturated simulator's wait for its own loop.
    Puts ("ready", index, None), then ("report", index, {"pings": [(due, answered or None)], "probe": its Sim's
    report})."""
    import uvloop

    async def main() -> dict[str, Any]:
        ctx = zmq.Context()
        keys = spec["keys"]
        name = spec["name"]
        answered: dict[int, float] = {}
        loop = asyncio.get_running_loop()
        welcomed, probe_ready = loop.create_future(), loop.create_future()
        probe = loop.create_task(Sim(spec["probe"], stop).run(lambda: probe_ready.set_result(True)))

        def on_frames(frames: list) -> None:
            kind = frames[0].bytes[0]
            if kind == Kind.GENERATE_RESULT:
                answered[unpack(frames[1].buffer)[0]] = time.perf_counter()
            elif kind == Kind.WELCOME and not welcomed.done():
                welcomed.set_result(True)

        link = Link(ctx, name, spec["endpoint"], None if keys is None else (keys[0], keys[1][name]), on_frames)
        link.send(encode(Hello("env_worker", name, "", 0, PROTOCOL_VERSION, os.getpid())))
        async with asyncio.timeout(JOIN_TIMEOUT_S):
            joined = asyncio.gather(welcomed, probe_ready)
            await asyncio.wait({joined, probe}, return_when=asyncio.FIRST_COMPLETED)
            if probe.done():  # (before the window it ends only on an error)
                probe.result()
                raise RuntimeError("the probe worker stopped before it was welcomed")
            await joined
        spec["out"].put(("ready", spec["index"], None))
        payload = encode(Generate(0, PING_POLICY, name, 0.0, np.zeros(8, np.int32), 1, 1, 1.0, 1.0, False, [0]))[2]
        interval, due = spec["ping_s"], []
        start = time.perf_counter() + interval
        deadline = start + spec["max_s"]
        while not stop.is_set() and time.perf_counter() < deadline:
            at = start + len(due) * interval
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            link.send([GENERATE, pack([len(due), PING_POLICY, name, time.time() + REQUEST_TIMEOUT_S]), payload])
            due.append(at)
        await asyncio.sleep(0.5)  # (the answers to the last pings)
        link.close()
        ctx.term()
        return {"pings": [(at, answered.get(i)) for i, at in enumerate(due)], "probe": await probe}

    try:
        report = uvloop.run(main())
    except BaseException as e:
        spec["out"].put(("failed", spec["index"], f"ping peer: {type(e).__name__}: {e}"))
        raise
    spec["out"].put(("report", spec["index"], report))
