"""The router: the hub of the deployment (DESIGN.md sections 3 and 4).

It forwards each Generate to the replica of its policy with the fewest outstanding requests and each
result back to its origin, dispatches the iteration's episodes to env workers (`EpisodeBook`), holds each
episode's groups until it is done and then routes them to the trainers of their policies, and runs the
iteration barrier as the version clock (`VersionClock`) says:

1. dispatch the iteration's episodes at the clock's version v (and, every few iterations, the held-out
   eval episodes; beside the run's first evaluation, the env's reference policies on the same problems,
   `rollout/baseline.py`, which no step waits for);
2. forward each finished episode's groups to the trainers, counted per policy and version by the clock
   (where groups stream by turn, `Config.streams_turns`, each as it comes, counted when its attempt is
   done; a failed or abandoned attempt's are `Withdrawn`);
3. when every episode of iteration v is in, send TrainStep(v) to every trainer; trainers step in
   parallel and broadcast weights v+1; each inference server acknowledges WeightsLoaded(v+1); when the
   clock says the step is complete it advances, and only then does iteration v+1 start (strict mode).
   With bounded staleness (`rollout.max_staleness` k) the books of iterations up to v+k are open while
   step v runs, and their training episodes keep the env workers busy (docs/staleness.md).

On the hot path (Generate, GenerateResult, Groups) only the kind byte and the small header frame are
decoded, through named header views; payload frames are forwarded untouched. With CURVE the sender of a
message is the process its key was issued to (the connection's User-Id, `runtime/curve.py`), never the
socket identity it chose: a Hello whose peer id is not its key's is refused, and once a process joined,
only the connection it joined with speaks for it (each connection's identity is new and random, so
another one can neither pose as it nor take the router's messages to it over). A message is taken only
from a peer that joined (said Hello and was welcomed) and only of a kind its role sends (`SENDERS`);
anything else, and values the run cannot have (a Groups of a policy it lacks, a negative count), is
dropped and counted (`router/refused_messages`), as an undecodable message is (`router/malformed`):
neither reaches a trainer or an env worker, neither stops the run, and their warnings are rate-limited.
A lost env worker's episodes run again elsewhere; a lost inference replica's requests go to a live replica
of its policy (or wait for its replacement). The router learns of a loss from the launcher as soon as it
restarts the process (RUN_DIR/restarted.jsonl, `lost_peers.py`; also for a process that died before its
first Hello), from the replacement's Hello, or from silence, whichever comes first. A lost replica leaves
its policy's weight group at once (`membership.py`: the next generation holds the live replicas, and the
version clock waits only for them); its replacement joins when it says Hello, catches up to the version
the others hold, and gets requests once it reported it (docs/faults.md).
With `cluster.leases` the data path leaves the router (`leases.py`): each env worker is told which replicas
of each policy it may send its Generates to, directly, and the router routes only the requests of a policy
that has no live replica (its workers send them here; they wait for the replacement as above). The workers
also send each episode's Groups straight to the trainer rank its RunEpisode names; the router counts a
done episode's samples from its EpisodeDone and tells the rank which attempts to train (`Accepted`).
Peer liveness lives in `PeerTable`, the metrics row in `report.py`, lost processes in `faults.py`; the
router writes RUN_DIR/metrics.jsonl.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import zmq

from mas_async.api.registry import ENVS, resolve
from mas_async.checkpoint import checkpoint_due, load_best, prune_checkpoints, save_best, save_router
from mas_async.config import Config
from mas_async.deployment import Deployment
from mas_async.disk_full import DiskFull, named_if_full
from mas_async.held_out import run_problems
from mas_async.metrics import Keys, MetricsWriter, keep_rows_before
from mas_async.peer_names import trainer_peer, trainer_rank
from mas_async.placement import replica_names
from mas_async.rollout.baseline import check_baseline_names
from mas_async.router.clock import ClockError, StepTimeout, VersionClock
from mas_async.router.episodes import EpisodeBook, EpisodeTask, plan_episodes
from mas_async.router.faults import FaultLog, replaced_alone, run_restart_from_env
from mas_async.router.idle import IdleTimer
from mas_async.router.leases import LeaseBook, endpoint_error
from mas_async.router.loop_lag import LoopLag
from mas_async.router.lost_peers import RESTARTED_FILE, LostPeers, record_lost_peer
from mas_async.router.membership import WeightGroups, replica_index
from mas_async.router.peers import PeerInfo, PeerTable
from mas_async.router.report import iteration_row
from mas_async.router.stop_request import STOP_REQUEST, stop_requested
from mas_async.runtime.actor import Actor, PeerDead, make_socket
from mas_async.runtime.curve import RunAuthenticator, secure_server
from mas_async.runtime.handshakes import RefusedHandshakes
from mas_async.runtime.log_limit import LogLimit, printable
from mas_async.runtime.router_socket import RouterSocket
from mas_async.runtime.run_failed import RunFailed
from mas_async.startup import startup_bound_reason, startup_bound_s
from mas_async.untrained import UntrainedWatch
from mas_async.wandb_run import WandbRun
from mas_async.wire.codec import CodecError
from mas_async.wire.messages import (
    PROTOCOL_VERSION,
    Accepted,
    EpisodeDone,
    Generate,
    GenerateResult,
    Groups,
    Heartbeat,
    Hello,
    Message,
    ReformWeightGroup,
    Shutdown,
    Trained,
    TrainStep,
    UpdateWeights,
    WeightsLoaded,
    Welcome,
    Withdrawn,
    decode,
    encode,
    peek,
)

log = logging.getLogger("mas_async.router")

SENDERS: dict[type[Message], str] = {
    Generate: "env_worker",
    Groups: "env_worker",
    EpisodeDone: "env_worker",
    GenerateResult: "inference",
    WeightsLoaded: "inference",
    Trained: "trainer",
    UpdateWeights: "trainer",
}
"""The role that sends each kind to the router. Besides these, any peer that joined sends Heartbeat, and
anyone Hello; every other kind is the router's own (Welcome, Shutdown, RunEpisode, TrainStep)."""
OWN_POLICY = (Trained, UpdateWeights, WeightsLoaded)
"""Kinds that a trainer or an inference server sends only about a policy it serves."""
MAX_COUNT = 1 << 31
"""Bound of a Groups message's sample and token counts: far above any episode's, far below what would
overflow the sums the router sends on (msgpack integers are 64-bit)."""
HEARTBEAT_SLICES = 10
"""The router sends its heartbeats in this many slices of the peers, spread over each heartbeat interval."""
DISPATCH_SLICE = 64
"""The most RunEpisodes one turn of the router's loop sends (~55 us each on a 2-core machine here): an iteration
of thousands of episodes opening at once would otherwise hold the loop (and every message waiting on it) for
~100 ms (docs/scale.md)."""
DISPATCH_S = 0.0005
"""The most seconds one turn of the router's loop spends dispatching, once it sent `DISPATCH_MIN` (a slice stops
early on a loaded machine)."""
DISPATCH_MIN = 16
"""The RunEpisodes a slice sends whatever the time (an iteration of a few episodes goes out in one turn)."""


def peer_role(name: str) -> str:
    """The role of a peer by its name (socket identity): "env_worker/0" -> "env_worker"."""
    return name.split("/", 1)[0]


def expected_peers(config: Config, training: bool) -> set[str]:
    """Names of every peer of a deployment (their socket identities)."""
    names = {f"env_worker/{i}" for i in range(config.cluster.env_workers)}
    for policy, spec in config.policies.items():
        names |= set(replica_names(config, policy, training))
        if training:
            names |= {trainer_peer(policy, r) for r in range(spec.trainer_ranks)}
    return names


class Router(Actor):
    role = "router"

    def __init__(self, config: Config, deployment: Deployment, run_dir: Path, curve_secret: str | None = None) -> None:
        super().__init__("router")
        self.curve_secret = curve_secret
        """The router's CURVE secret key (None: the one the launcher gave this process)."""
        self.routes: dict[bytes, bytes] = {}
        """Peer name -> the socket identity of the connection it joined with (the name itself without CURVE)."""
        self.sent_at: dict[bytes, float] = {}
        """Peer name -> when the router last sent it a message (time.monotonic(); `_heartbeats`)."""
        self.cfg = config
        self.heartbeat_s = config.heartbeat_interval_s()
        """The peers' heartbeat interval, and the router's (`cluster.heartbeat_s`, longer with many processes)."""
        self.deployment = deployment
        self.run_dir = run_dir
        self.policies = list(config.policies)
        self.table = PeerTable(expected_peers(config, deployment.training))
        self.all_joined = asyncio.Event()
        self._pending: dict[tuple[bytes, int], tuple[bytes, Any, list]] = {}
        """(origin, request id) -> (the inference replica serving it, the request's header and frames: sent
        again to another replica if that one is lost)."""
        self._parked: dict[str, list[tuple[bytes, Any, list]]] = {}
        """policy -> requests waiting for a replica (every replica of the policy is being replaced)."""
        self._accepting: dict[tuple[str, int, int], list[list]] = {}
        """With leases: (policy, trainer rank, iteration) -> episodes accepted and not yet sent (`Accepted`)."""
        self._accept_soon = False
        self.routed = 0
        """Generate requests of env workers forwarded to a replica since the last row."""
        self.streams_turns = config.streams_turns()
        """Forward each Groups message at once, not at its episode's end (`Config.streams_turns`)."""
        self.leases = (
            LeaseBook(
                {p: config.policies[config.server_policy(p, deployment.training)].replicas for p in config.policies},
                config.cluster.env_workers,
                config.cluster.lease_replicas,
            )
            if config.cluster.leases
            else None
        )
        """With `cluster.leases`: the replicas' endpoints and the leases the env workers hold."""
        training = deployment.training
        self.groups = WeightGroups(
            {p: config.policies[config.server_policy(p, training)].replicas for p in config.policies}
        )
        """Each policy's weight group: its members and generation, and the orders that change them."""
        self.replacing: set[str] = set()
        """Processes that died before they said Hello (the launcher's word): the run need not wait for them."""
        self.restarted = LostPeers(run_dir, RESTARTED_FILE, from_start=True)
        """The launcher's records of the processes it restarted (this start of the run's only)."""
        loads = [
            (policy, name)
            for policy in self.policies
            for name in replica_names(config, config.server_policy(policy, training), training)
        ]
        ranks = {policy: spec.trainer_ranks for policy, spec in config.policies.items()}
        self.clock = VersionClock(
            self.policies, loads, deployment.start_version, config.rollout.max_staleness, ranks
        )  # fmt: skip
        self.books: dict[int, EpisodeBook] = {}
        """iteration -> its book, from when the clock lets it open until its row is written."""
        self._next_book = deployment.start_version
        self.idle = IdleTimer(time.monotonic())
        """Time with no episode in flight (no request can reach an inference server)."""
        self._dispatch_due = False
        """Whether a dispatch stopped at its slice and the rest is to go on the loop's next turn."""
        self.loop_lag = LoopLag()
        """How late this process's event loop runs (every row's router/loop_lag_*)."""
        env_cls = resolve(config.env.name, ENVS, "env")
        self.baseline_names = check_baseline_names(config.env.name, list(env_cls.reference_policies()))
        """The env's reference policies, played once per run beside the first evaluation."""
        self.train_problems, self.test_problems = run_problems(
            env_cls, config.env.train_size, config.env.test_size, config.env.options
        )
        self._order = list(range(len(self.train_problems)))
        random.Random(config.run.seed).shuffle(self._order)
        self.start = deployment.start_version
        """The first iteration of this run; iteration v trains the step from version v."""
        self._baselines_due = config.eval.baselines and (self.start == 0 or not deployment.training)
        """Whether the next evaluation brings the baselines (a resumed run has them in its rows already)."""
        replaced = []
        if (run_dir / "metrics.jsonl").exists():  # a resumed or restarted run: rows from `start` on are redone
            replaced = keep_rows_before(run_dir / "metrics.jsonl", self.start)
        wandb = None
        if config.metrics.wandb is not None:
            job_type = "train" if deployment.training else "eval"
            wandb = WandbRun(config.metrics.wandb, config, run_dir, job_type=job_type)
        self.metrics = MetricsWriter(run_dir / "metrics.jsonl", tensorboard=config.metrics.tensorboard, wandb=wandb)
        self.started = time.monotonic()
        self.stopped_at: int | None = None
        """The version the run stopped at when asked to (`stop_request.py`); None while it goes on."""
        self._step_done = asyncio.Event()
        self.refusals = RefusedHandshakes()
        """ZeroMQ handshakes refused so far (peers without the run's CURVE key), a logged counter."""
        self.refused = 0
        """Well-formed messages dropped so far: from a sender that never joined, of a kind its role does
        not send, or with values the run cannot have (a logged counter, `router/refused_messages`)."""
        self.warnings = LogLimit()
        """Rate limit of the warnings a flood of bad messages would repeat."""
        self.best = load_best(run_dir) if deployment.training else None
        """{"version", "score"} of the best held-out evaluation so far (its checkpoint is kept)."""
        self.poisoned_problems: set[str] = set()
        """Problems whose episode was dropped as poisoned: not dispatched again in this run."""
        self.faults = FaultLog()
        self.untrained = UntrainedWatch(config.trainer.max_untrained_iterations, fresh=self.start == 0)
        """Training iterations in a row in which each policy trained nothing (a named stop at the limit)."""
        self.faults.carry(replaced)  # faults seen in the iterations run again are still counted, once
        restart = run_restart_from_env()
        if restart is not None:  # the launcher restarted the whole run after losing this role
            self.faults.restarted(*restart)

    @property
    def peers(self) -> dict[bytes, PeerInfo]:
        return self.table.peers

    # -- sockets -----------------------------------------------------------------------------------

    async def setup(self) -> None:
        """Socket: ROUTER bound at the deployment's endpoint, driven by `RouterSocket` (plain pyzmq
        calls woken by the event loop). ROUTER_MANDATORY makes a send to an unknown or vanished
        identity an error (logged) instead of a silent drop; at the high-water mark sends wait in an
        outbox rather than drop. With the deployment's keys it is a CURVE server whose context's ZAP
        handler admits only the keys of the run's processes, each as its process (started before the bind,
        so no handshake goes unchecked); every refused handshake is counted and logged, and the run goes on.
        Without keys a restarted peer reconnects under its predecessor's identity, and ROUTER_HANDOVER lets
        it take the identity over even if the old connection is not closed yet (a lost node); with keys
        every connection has an identity of its own, and none takes another's over."""
        assert self.ctx is not None
        sock = make_socket(self.ctx, zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        authenticator = None
        if self.deployment.keys_dir is None:
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        else:
            secure_server(sock, self.deployment.keys_dir, self.curve_secret)
            authenticator = RunAuthenticator(self.ctx, self.deployment.keys_dir)
            authenticator.start()
            self.spawn(authenticator.serve(), "zap")
        self.spawn(self.refusals.watch(sock, authenticator), "refused-handshakes")
        sock.bind(self.deployment.router_endpoint)
        self.io = RouterSocket(zmq.Socket.shadow(sock.underlying), self._on_frames, spawn=self.spawn)
        self._sock = sock  # owns the socket (closed with the context)
        self.spawn(self.io.run(), "receive")
        self.spawn(self._watchdog(), "watchdog")
        self.spawn(self.loop_lag.run(), "loop-lag")
        log.info("router bound at %s; waiting for %d peers", self.deployment.router_endpoint, len(self.table.expected))

    def send_to(self, identity: bytes, msg: Message) -> None:
        self.forward(identity, encode(msg))

    def forward(self, identity: bytes, frames: list) -> None:
        self.io.send([self.routes.get(identity, identity), *frames])
        self.sent_at[identity] = time.monotonic()

    def fan_out(self, identities: list[bytes], frames: list) -> None:
        """`forward` to each of `identities`, a slice at a time (`RouterSocket.fan_out`)."""
        now = time.monotonic()
        for identity in identities:
            self.sent_at[identity] = now
        self.io.fan_out([self.routes.get(identity, identity) for identity in identities], frames)

    def _on_frames(self, frames: list) -> None:
        route, body = frames[0].bytes, frames[1:]
        identity = route if self.deployment.keys_dir is None else self._key_name(route, body)
        if identity is None:
            return
        try:
            cls, header = peek(body)  # (the frames as received: no view of each to make)
            if cls is not Hello:
                peer = self.peers.get(identity)
                if peer is None:
                    self.refuse(identity, cls, "its sender never joined")
                    return
                peer.last_seen = time.monotonic()  # (a peer that sends anything skips its heartbeats)
                if self.routes.get(identity) != route:
                    self.refuse(identity, cls, "it came over another connection than the one its sender joined with")
                    return
                if cls is not Heartbeat and SENDERS.get(cls) != peer.role:
                    self.refuse(identity, cls, f"a {peer.role} does not send it")
                    return
                if cls in OWN_POLICY and header.policy not in peer.policies:
                    self.refuse(identity, cls, "it names a policy its sender does not serve")
                    return
            if cls is Generate:
                if header.origin.encode() != identity:
                    self.refuse(identity, cls, "its origin is not its sender")
                    return
                self.routed += 1
                self._route_generate(identity, header, body)
            elif cls is GenerateResult:
                self._route_result(identity, header, body)
            elif cls is Groups:
                self._hold_groups(identity, header, body)
            else:
                if cls is Hello:
                    self._on_hello(identity, decode([f.buffer for f in body]), route)  # type: ignore[arg-type]
                elif cls is not Heartbeat:
                    self._handle(identity, decode([f.buffer for f in body]))
        except CodecError as e:
            self.malformed += 1
            if n := self.warnings.due("malformed"):
                log.warning("dropped a malformed message from %s (%d so far): %s", printable(identity), n, e)

    def _key_name(self, route: bytes, body: list) -> bytes | None:
        """The process whose key the connection holds: the User-Id that the ZAP handler gave it, which
        libzmq attaches to every frame of the connection (None, counted as malformed, if there is none)."""
        try:
            return body[0].get("User-Id").encode()
        except (zmq.ZMQError, IndexError, AttributeError):
            self.malformed += 1
            if n := self.warnings.due("no user id"):
                log.warning("dropped a message from %s without a User-Id (%d so far)", printable(route), n)
            return None

    def refuse(self, identity: bytes, cls: type[Message], why: str) -> None:
        """Drop a well-formed message that the run must not act on; counted, and logged rate-limited (`why`
        is one of a few fixed reasons: it keys the rate limit)."""
        self.refused += 1
        if n := self.warnings.due((cls, why)):
            log.warning(
                "dropped a %s from %s: %s (%d such so far, %d refused messages in all)",
                cls.__name__, printable(identity), why, n, self.refused,
            )  # fmt: skip

    # -- hot path: header-only forwarding ----------------------------------------------------------

    def _route_generate(self, origin: bytes, header: Any, frames: list) -> None:
        # The header does not carry n: requests are counted, close enough for balancing.
        chosen = self.table.pick_replica(header.policy)
        if chosen is None:
            if header.policy in self.clock.ranks:  # its replicas are being replaced: the request waits
                self._parked.setdefault(header.policy, []).append((origin, header, frames))
                return
            reply = f"no inference server for policy {header.policy!r}"
            self.send_to(origin, GenerateResult(header.request_id, origin.decode(), reply, []))
            return
        server, info = chosen
        self.table.set_outstanding(server, info.outstanding + 1)
        self._pending[(origin, header.request_id)] = (server, header, frames)
        self.forward(server, frames)

    def _route_result(self, server: bytes, header: Any, frames: list) -> None:
        origin = header.origin.encode()
        key = (origin, header.request_id)
        pending = self._pending.get(key)
        if pending is None or pending[0] != server:  # only the replica serving a request answers it, once
            self.refuse(server, GenerateResult, "it answers no request that its sender is serving")
            return
        del self._pending[key]
        self.table.set_outstanding(server, self.peers[server].outstanding - 1)
        self.forward(origin, frames)
        if self.faults.recovering(server) and (recovered := self.faults.result_from(server)) is not None:
            log.info("recovered from a lost replica in %.1fs (first result of %s)", recovered, server.decode())

    def _hold_groups(self, worker: bytes, header: Any, frames: list) -> None:
        if header.policy not in self.clock.ranks:
            self.refuse(worker, Groups, "its policy is not one of the run's")
            return
        if not (0 <= header.n_samples <= MAX_COUNT and 0 <= header.n_tokens <= MAX_COUNT):
            self.refuse(worker, Groups, f"its counts are not between 0 and {MAX_COUNT}")
            return
        book = self.books.get(header.iteration)
        task = book.current(header.episode_id, header.iteration, header.attempt) if book is not None else None
        if task is not None and task.msg.mode != "train":  # eval and baseline episodes record nothing
            self.refuse(worker, Groups, "its episode is not a training episode")
            return
        if self.streams_turns and task is not None:
            assert book is not None
            self._forward_now(book, task, header, frames)
            return
        if book is None or not book.hold_groups(header, frames):
            # An abandoned attempt, a timed-out episode or an old iteration (counted as late): its
            # samples must never reach a trainer (counted twice, or from weights that are gone).
            log.warning("dropped late groups of episode %s (attempt %s)", header.episode_id, header.attempt)

    def _forward_now(self, book: EpisodeBook, task: EpisodeTask, header: Any, frames: list) -> None:
        """A group streamed by turn, to its trainer rank at once; its samples count into the step when the
        attempt is done (`_on_episode_done`), and are withdrawn if it fails or is abandoned (`_withdraw`)."""
        policy = header.policy
        # Spread by problems (a problem's first group comes long before any sample of the iteration counts as
        # a rank's load), as with leases.
        ranks = self.clock.ranks[policy]
        rank = book.trainer_rank(policy, task.msg.problem_id, lambda: book.fewest_problems(policy, ranks))
        counts = task.streamed.setdefault((policy, rank), [0, 0])
        counts[0] += header.n_samples
        counts[1] += header.n_tokens
        self.forward(trainer_peer(policy, rank).encode(), frames)

    def _withdraw(self, book: EpisodeBook, task: EpisodeTask) -> None:
        """Tell the trainer ranks that got groups of `task`'s attempt before it ended that they must not train."""
        msg = task.msg
        for policy, rank in sorted(task.streamed):
            withdrawn = Withdrawn(policy, book.iteration, msg.episode_id, msg.attempt)
            self.send_to(trainer_peer(policy, rank).encode(), withdrawn)
        if task.streamed:
            log.warning("withdrew the streamed groups of episode %s (attempt %d)", msg.episode_id, msg.attempt)
        task.streamed.clear()

    # -- control messages --------------------------------------------------------------------------

    def _handle(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, EpisodeDone):
            if msg.leases:
                self._count_leased(identity, msg.leases)
            self._on_episode_done(msg)
        elif isinstance(msg, UpdateWeights):
            frames = encode(msg)  # once for all the policy's replicas (a thousand at a large run)
            self.fan_out(list(self.table.of_policy("inference", msg.policy, alive=True)), frames)
        elif isinstance(msg, Trained):
            if msg.error.startswith(f"{DiskFull.__name__}: "):  # (a restart would fill the disk again)
                raise DiskFull(f"trainer of policy {msg.policy!r}: {msg.error.removeprefix('DiskFull: ')}")
            if msg.error:
                raise RuntimeError(f"trainer of policy {msg.policy!r} failed: {msg.error}")
            self.clock.trained(msg.policy, msg.version, msg.metrics, trainer_rank(identity.decode()))
            self._check_step_done()
        elif isinstance(msg, WeightsLoaded):
            self._on_loaded(identity, msg)
        else:
            self.refuse(identity, type(msg), "no peer sends it to the router")

    def _forget_route(self, name: str, *routes: bytes | None) -> None:
        """Drop the messages still waiting for a replaced peer's routes (`RouterSocket.forget`): the replacement's
        Welcome is the first message it gets, and what waited was for its predecessor (a catch-up order follows)."""
        dropped = sum(self.io.forget(r) for r in dict.fromkeys(routes) if r is not None)
        if dropped:
            log.info("dropped %d message(s) still waiting for the replaced %s", dropped, name)

    def _on_hello(self, identity: bytes, msg: Hello, route: bytes | None = None) -> None:
        """A peer says who it is (`identity`: with CURVE, the process its key was issued to) over the
        connection `route` (its socket identity; `identity` itself without CURVE)."""
        name = identity.decode("utf-8", "replace")
        if name not in self.table.expected:
            self.refuse(identity, Hello, "its sender is not a peer of this run")
            return
        if msg.peer_id != name or msg.role != peer_role(name):
            why = "its peer_id or role is not its sender's"
            self.refuse(identity, Hello, why if self.deployment.keys_dir is None else f"{why} (its key's)")
            return
        if msg.role in ("inference", "trainer") and msg.policy != name.split("/")[1]:
            self.refuse(identity, Hello, "its policy is not the one its name says")
            return
        if msg.protocol != PROTOCOL_VERSION:
            raise RuntimeError(f"{name} speaks protocol {msg.protocol}, the router {PROTOCOL_VERSION}")
        if self.leases is not None and msg.role != "env_worker" and (why := endpoint_error(msg.endpoint)):
            self.refuse(identity, Hello, why)
            return
        previous = self.peers.get(identity)
        # A replacement of a lost process: another pid, or the launcher says so (died_at) even when the lost
        # one never joined. (The same process saying Hello again joins again, as it was.)
        repeated = previous is not None and previous.pid == msg.pid
        replacement = not repeated and (previous is not None or bool(msg.died_at))
        if replacement:
            if previous is not None and previous.alive:
                self._lose(identity, previous, f"replaced by pid {msg.pid}")
            elif previous is None and name not in self.replacing:  # it died before its Hello
                self._lost_before_hello(name)
            self.faults.replacement_joined(identity, msg.died_at or time.time())
        self.replacing.discard(name)
        if replacement:  # what still waits for the predecessor (a sliced fan-out's copy) must not reach this one
            self._forget_route(name, self.routes.get(identity), identity if route is None else route)
        # A replacement replica of a training run serves once it loaded the weights the others hold.
        serving = not (replacement and msg.role == "inference" and self.deployment.training)
        served = self.cfg.served_policies(msg.policy, self.deployment.training) if msg.role == "inference" else []
        info = PeerInfo(msg.role, msg.policy, msg.capacity, msg.pid, policies=tuple(served))
        self.routes[identity] = identity if route is None else route
        if self.leases is not None and msg.role == "inference":
            self.leases.joined(identity, msg.endpoint)
        elif self.leases is not None and msg.role == "trainer":
            self.leases.trainers[name] = msg.endpoint
        self.table.join(identity, info, serving)
        self.send_to(identity, Welcome(PROTOCOL_VERSION))
        log.info("%s joined (pid %d); %d/%d peers", name, msg.pid, len(self.peers), len(self.table.expected))
        leasing = self.leases is not None and self.leases.started  # (at the start every worker gets them at once)
        self._check_all_joined()
        if msg.role == "inference":  # (a replacement of a training run is leased once it caught up)
            self._renew_leases(serving=identity if replacement and serving else None)
        if msg.role == "env_worker":
            if leasing and self.leases is not None:
                self.send_to(identity, self.leases.trainers_message())
                for lease in self.leases.every(self.table, identity):
                    self.send_to(identity, lease)
            self._dispatch()  # a replacement takes queued episodes (its predecessor's among them) at once
        elif replacement and not serving:  # ready: it joins the weight group, catching up first
            for policy in info.policies:
                self._send_order(self.groups.add(policy, replica_index(name)))
        elif replacement:  # (an evaluation's replica: no weight group, it serves the weights it started with)
            for policy in info.policies:
                for origin, header, frames in self._parked.pop(policy, []):
                    self._route_generate(origin, header, frames)
        elif msg.role in ("inference", "trainer") and self.deployment.training:  # it may have missed an order
            for policy in info.policies if msg.role == "inference" else [msg.policy]:
                if (order := self.groups.orders.get(policy)) is not None:
                    self._send_order(order, only=identity)

    def _check_all_joined(self) -> None:
        """The run may start once every peer joined, but for those whose first process died before its Hello
        (their replacements join when they are ready); with leases, every env worker gets them then."""
        if self.all_joined.is_set() or not self.table.all_joined_but(self.replacing):
            return
        self.all_joined.set()
        if self.leases is not None:
            self.leases.started = True
            trainers = encode(self.leases.trainers_message())
            for worker in self.table.live_workers():
                self.forward(worker, trainers)
            self._renew_leases()  # (each policy's serving replicas found once, not once per worker)

    def _renew_leases(self, serving: bytes | None = None) -> None:
        """Send each live env worker its leases whose replicas changed (none before the run starts).
        `serving`: a replacement replica that serves from now on: with leases its first result goes to an env
        worker, not through the router, so its recovery ends here, as it is leased again."""
        if self.leases is None or not self.leases.started:
            return
        for worker, lease in self.leases.changed(self.table, self.table.live_workers()):
            self.send_to(worker, lease)
        if serving is None or not self.faults.recovering(serving):
            return
        if (recovered := self.faults.result_from(serving)) is not None:
            log.info("recovered from a lost replica in %.1fs (%s is leased again)", recovered, serving.decode())

    def _count_leased(self, worker: bytes, counts: dict) -> None:
        """An env worker's lease counts since its previous EpisodeDone (`router/leases.py`); counts that are
        not counts are dropped and counted (the episode is taken all the same)."""
        if self.leases is None or not self.leases.count(counts, MAX_COUNT):
            self.refuse(worker, EpisodeDone, "its lease counts are not counts of this run")
            return
        self.faults.reissued_to_replicas(counts.get("resent", 0))

    def _send_order(self, order: ReformWeightGroup, only: bytes | None = None) -> None:
        """Send a weight group's order to its trainer (rank 0) and its members that joined (or to `only`)."""
        server_policy = self.cfg.server_policy(order.policy, self.deployment.training)
        names = [trainer_peer(order.policy, 0)] + [f"inference/{server_policy}/{i}" for i in order.members]
        if only is None:
            log.info("re-forming the weight group of %s: generation %d, replicas %s%s", order.policy, order.generation,
                     order.members, f" ({order.fresh} catching up first)" if order.fresh else "")  # fmt: skip
        for name in names:
            ident = name.encode()
            info = self.peers.get(ident)
            if info is not None and info.alive and (only is None or ident == only):
                self.send_to(ident, order)

    def _leave_groups(self, name: str, policies: tuple[str, ...] | list[str]) -> None:
        """A lost replica leaves the weight groups of `policies` now: the clock stops waiting for its loads."""
        if not self.deployment.training:
            return
        for policy in policies:
            self.clock.drop_load(policy, name)
            if (order := self.groups.remove(policy, replica_index(name))) is not None:
                self._send_order(order)
        self._check_step_done()

    def _lost_before_hello(self, name: str) -> None:
        """Process `name` died before it said Hello (its replacement is on its way): the run does not wait for
        it, and a replica leaves the weight groups it was to be in."""
        self.replacing.add(name)
        if peer_role(name) == "inference":
            self._leave_groups(name, self.cfg.served_policies(name.split("/")[1], self.deployment.training))
        self._check_all_joined()

    def _on_loaded(self, identity: bytes, msg: WeightsLoaded) -> None:
        """A replica loaded `msg.version` of a policy: a step's new version (the clock counts it), or the
        version the others hold (a replacement's catch-up: it is routed requests from now on)."""
        name = identity.decode()
        if msg.error:
            raise RuntimeError(f"{name} failed to load weights v{msg.version}: {msg.error}")
        serving = msg.policy in self.peers[identity].routed
        if msg.version < self.clock.version and not serving:
            return  # a catch-up that a step overtook: the step's version reaches it in the new generation
        if msg.version != self.clock.version:  # (the version held: a catch-up, or sent again after a re-form)
            self.clock.loaded(msg.policy, name, msg.version)
        if self.table.serve(identity, msg.policy):  # a replacement holds the weights the others serve
            log.info("%s serves %s v%d", name, msg.policy, msg.version)
            self.groups.caught_up(msg.policy, replica_index(name))
            self.clock.add_load(msg.policy, name)
            self._renew_leases(serving=identity)
            for origin, header, frames in self._parked.pop(msg.policy, []):
                self._route_generate(origin, header, frames)
        self._check_step_done()

    def _on_episode_done(self, msg: EpisodeDone) -> None:
        book = self.books.get(msg.iteration)
        task = book.finish(msg) if book is not None else None
        if task is None:
            log.warning("dropped a late result of episode %s (attempt %d)", msg.episode_id, msg.attempt)
            return
        assert book is not None
        if task.worker in self.peers:
            self.table.episode_ended(task.worker, task.alone)
        if msg.error:
            log.error("episode %s failed: %s", msg.episode_id, msg.error)
        elif task.worker is not None and (recovered := self.faults.result_from(task.worker)) is not None:
            log.info("recovered from a lost process in %.1fs (first episode done since: %s)", recovered, msg.episode_id)
        if msg.error:
            self._withdraw(book, task)
        for (policy, rank), (samples, tokens) in task.streamed.items():
            self.clock.forwarded(policy, book.version, samples, rank, tokens)
        for policy, samples, tokens, frames in task.groups:
            rank = book.trainer_rank(
                policy, task.msg.problem_id, lambda p=policy: self.clock.least_loaded_rank(p, book.version)
            )
            self.clock.forwarded(policy, book.version, samples, rank, tokens)
            self.forward(trainer_peer(policy, rank).encode(), frames)
        if self.leases is not None and not msg.error and task.msg.mode == "train" and task.worker is not None:
            self._accept_direct(book, task, msg.samples, routed={group[0] for group in task.groups})
        self._dispatch()

    def _trainer_ranks(self, book: EpisodeBook, problem_id: str) -> dict[str, int]:
        """With leases: the trainer rank of each policy with several that an episode of `problem_id` sends its
        groups to straight (`RunEpisode.trainer_ranks`): the same for every episode of the problem, new
        problems spread over the ranks by count (the tokens are not known before the episodes run)."""
        return {
            policy: book.trainer_rank(policy, problem_id, lambda p=policy, n=ranks: book.fewest_problems(p, n))
            for policy, ranks in self.clock.ranks.items()
            if ranks > 1
        }

    def _accept_direct(self, book: EpisodeBook, task: EpisodeTask, samples: dict, routed: set[str]) -> None:
        """With leases: an episode is done whose Groups went straight to the trainers (those of `routed`
        policies came through here). Count each policy's samples (`EpisodeDone.samples`) into its step and
        tell its trainer rank to take them (`Accepted`, sent in a batch at the end of this loop turn)."""
        assert task.worker is not None
        for policy, count in samples.items():
            if policy in routed:
                continue
            if policy not in self.clock.ranks or type(count) is not int or not 0 <= count <= MAX_COUNT:
                self.refuse(task.worker, EpisodeDone, "its sample counts are not counts of the run's policies")
                continue
            if count == 0:
                continue
            rank = task.msg.trainer_ranks.get(policy, 0)
            self.clock.forwarded(policy, book.version, count, rank)
            entry = [task.msg.episode_id, task.msg.attempt, task.worker.decode(), count]
            self._accepting.setdefault((policy, rank, book.iteration), []).append(entry)
            self.leases.groups += 1
        if self._accepting and not self._accept_soon:
            self._accept_soon = True
            asyncio.get_running_loop().call_soon(self._send_accepted)

    def _send_accepted(self) -> None:
        """Send the trainers the episodes accepted since the last call, one Accepted per rank and iteration."""
        self._accept_soon = False
        accepting, self._accepting = self._accepting, {}
        for (policy, rank, iteration), episodes in accepting.items():
            self.send_to(trainer_peer(policy, rank).encode(), Accepted(policy, iteration, episodes))

    def _check_step_done(self) -> None:
        if self.clock.step_complete():
            self._step_done.set()

    # -- episodes ----------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Hand queued episodes that the clock lets run, oldest iteration first, to the least-loaded live
        env workers, up to each one's capacity, taking them from each book's plan as they go; at most
        `DISPATCH_SLICE` of them or `DISPATCH_S` seconds, the rest on the loop's next turns (with no loop running,
        nothing waits on one: all of them)."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        now = time.monotonic()
        until = time.perf_counter() + DISPATCH_S
        sent = 0
        for book in sorted(self.books.values(), key=lambda b: b.iteration):
            queued, waiting = iter(book.queued), []
            book.queued = waiting
            while True:
                task = next(queued, None)
                if task is None and not waiting:  # every queued one went: take the plan's next (a task that
                    task = book.next_planned(self.poisoned_problems)  # waits would leave it waiting too)
                if task is None:
                    break
                if loop is not None and (
                    sent == DISPATCH_SLICE or (sent >= DISPATCH_MIN and time.perf_counter() > until)
                ):
                    waiting.append(task)  # the rest on the next turns, in the same order
                    waiting += queued
                    if not self._dispatch_due:
                        self._dispatch_due = True
                        loop.call_soon(self._dispatch_rest)
                    break
                if not self.clock.may_dispatch(book.version, task.msg.mode):
                    waiting.append(task)
                    continue
                if task.alone:  # a last attempt: on a worker that runs nothing else
                    worker = self.table.worker_for_alone()
                else:
                    worker = self.table.least_loaded_worker()
                if worker is None:
                    waiting.append(task)
                    continue
                task.worker = worker
                task.deadline = now + self.cfg.rollout.episode_timeout_s
                self.table.episode_started(worker)
                book.in_flight[task.msg.episode_id] = task
                if self.leases is not None and task.msg.mode == "train":
                    task.msg.trainer_ranks = self._trainer_ranks(book, task.msg.problem_id)
                self.send_to(worker, task.msg)
                sent += 1
            book.check_done()
        self.idle.update(now, busy=any(book.generating() for book in self.books.values()))

    def _dispatch_rest(self) -> None:
        """Go on with a dispatch that stopped at its slice (a turn of the loop later)."""
        self._dispatch_due = False
        self._dispatch()

    def _episodes(self, iteration: int, version: int, train: bool, evaluate: bool) -> Iterator[EpisodeTask]:
        baselines = []
        if evaluate and self._baselines_due:
            baselines, self._baselines_due = self.baseline_names, False
        return plan_episodes(
            self.cfg, self.train_problems, self.test_problems, self._order, iteration, version,
            train=train, evaluate=evaluate, baselines=baselines,
        )  # fmt: skip

    async def _watchdog(self) -> None:
        """Send every live peer a Heartbeat each heartbeat interval (`Config.heartbeat_interval_s`, a slice of them
        at a time: `_heartbeats`), take in the launcher's restarts, declare silent peers dead and drop episodes
        past their deadline."""
        while True:
            for part in range(HEARTBEAT_SLICES):
                await asyncio.sleep(self.heartbeat_s / HEARTBEAT_SLICES)
                self._heartbeats(part)
            for record in self.restarted.new():
                self._on_restarted(record["name"], record["pid"], record["at"])
            now = time.monotonic()
            for ident, info in self.table.silent(now, self.cfg.cluster.peer_timeout_s):
                self._peer_died(ident, info)
            for book in list(self.books.values()):
                for task in book.overdue(now):
                    msg = task.msg
                    log.error("episode %s timed out; counted as dropped", msg.episode_id)
                    self._on_episode_done(
                        EpisodeDone(msg.episode_id, msg.iteration, msg.mode, msg.attempt, "timed out", {}, {})
                    )

    def _heartbeats(self, part: int) -> None:
        """A Heartbeat to every live peer of slice `part` (every HEARTBEAT_SLICES-th peer by joining order)
        that was sent nothing else in the last interval (any message tells it the router is alive),
        encoded once: a thousand peers' heartbeats do not hold up the hot path in one burst."""
        frames, now = encode(Heartbeat(time.time())), time.monotonic()
        since = now - self.heartbeat_s
        for ident, info in itertools.islice(self.peers.items(), part, None, HEARTBEAT_SLICES):
            if info.alive and self.sent_at.get(ident, since) <= since:
                self.forward(ident, frames)

    def _on_restarted(self, name: str, pid: int, died_at: float) -> None:
        """The launcher found process `name` (pid `pid`) dead at `died_at` and started it again: it is lost
        from now on, whether it had joined or not, before its replacement is ready to say Hello."""
        info = self.peers.get(name.encode())
        if name not in self.table.expected:
            return
        self.faults.replaced(name, died_at)
        log.info("the launcher restarted %s (pid %d was found dead)", name, pid)
        if name in self.replacing:
            return
        if info is None:
            log.error("%s (pid %d) died before it joined; its replacement joins when it is ready", name, pid)
            self._lost_before_hello(name)
        elif info.alive and info.pid == pid:  # (else: about a predecessor, or its replacement joined first)
            self._lose(name.encode(), info, "found dead by the launcher")

    def _peer_died(self, ident: bytes, info: PeerInfo) -> None:
        """A peer silent past `peer_timeout_s`: an env worker's episodes or a replica's requests run again
        elsewhere and it is told to exit (non-zero: the launcher restarts it); any other role stops the run.
        Either way the launcher is told to kill it, in case it is hung and never reads the Shutdown."""
        silent = f"silent for over {self.cfg.cluster.peer_timeout_s}s"
        record_lost_peer(self.run_dir, ident.decode(), info.pid, silent)  # the launcher kills it, if it runs on
        if not replaced_alone(self.cfg, self.deployment, ident.decode()):
            raise PeerDead(f"{ident.decode()} (pid {info.pid}) has been {silent}")
        self._lose(ident, info, silent)
        self.send_to(ident, Shutdown(f"declared dead by the router: {silent}", True))

    def _lose(self, ident: bytes, info: PeerInfo, why: str) -> None:
        """Take a lost env worker or replica out of service. A worker's in-flight episodes go back to the
        queue as new attempts (whatever its old attempts still send is dropped) and run on the live
        workers; a replica's outstanding requests go to a live replica of its policy, or wait for one (a
        late result of the lost one is refused: the request is no longer its)."""
        self.table.mark_dead(ident)
        if info.role == "inference":
            self._leave_groups(ident.decode(), info.policies)
            requests = [(key, entry) for key, entry in self._pending.items() if entry[0] == ident]
            for (origin, _), (_, header, frames) in requests:
                del self._pending[(origin, header.request_id)]
                self._route_generate(origin, header, frames)
            self.table.set_outstanding(ident, 0)
            self._renew_leases()
            self.faults.reissued_to_replicas(len(requests))
            log.error("%s (pid %d) is lost (%s); its %d requests were sent again", ident.decode(), info.pid, why,
                      len(requests))  # fmt: skip
            return
        lost, max_attempts = 0, self.cfg.rollout.max_attempts
        for book in self.books.values():
            for task in [t for t in book.in_flight.values() if t.worker == ident and t.streamed]:
                self._withdraw(book, task)
            again, poisoned = book.requeue(ident, max_attempts)
            lost += again
            for task in poisoned:
                self.poisoned_problems.add(task.msg.problem_id)
                log.error(
                    "episode %s (problem %s) was running on %d lost env workers: dropped as poisoned (rollout/poisoned); "
                    "its problem is not dispatched again in this run", task.msg.episode_id, task.msg.problem_id,
                    task.msg.attempt + 1,
                )  # fmt: skip
        self.faults.reissued(lost)
        log.error(
            "%s (pid %d) is lost (%s); its %d episodes run again as new attempts", ident.decode(), info.pid, why, lost
        )
        self._dispatch()

    # -- the iteration barrier ---------------------------------------------------------------------

    async def main(self) -> None:
        bound_s = startup_bound_s(self.cfg)  # (a vLLM server says Hello once its engine has started)
        try:
            await asyncio.wait_for(self.all_joined.wait(), bound_s)
        except TimeoutError:
            missing = self.table.missing()
            raise PeerDead(
                f"peers never joined within {bound_s:g}s: {missing} (the bound: {startup_bound_reason(self.cfg)})"
            ) from None
        log.info("all %d peers joined; starting", len(self.table.expected))
        gc.freeze()  # start-up's objects (problems, modules) are never garbage: a full collection skips them
        self.idle = IdleTimer(time.monotonic())
        reason = "run finished"
        if self.deployment.training:
            for iteration in range(self.start, self.cfg.run.iterations + 1):
                await self._iteration(iteration, **self._plan(iteration))
                if self.stopped_at is not None:
                    reason = f"run stopped at its checkpoint of version {self.stopped_at}, to be resumed there"
                    log.info("%s (asked in %s)", reason, STOP_REQUEST)
                    break
        else:  # mas-async eval: one evaluation pass of the given weights
            row = await self._iteration(self.start, evaluate=True, train=False)
            (self.run_dir / "eval.json").write_text(json.dumps(row, indent=2))
        for ident in self.peers:
            self.send_to(ident, Shutdown(reason, False))
        await asyncio.sleep(0.5)  # let the Shutdown messages leave (and any still in the outbox)

    def _plan(self, iteration: int) -> dict[str, bool]:
        """What iteration `iteration` of a training run does: train (all but the last, which only
        evaluates the final weights) and evaluate (every `eval.every` iterations, and at the end)."""
        iterations, every = self.cfg.run.iterations, self.cfg.eval.every
        if iteration >= iterations:
            return {"train": False, "evaluate": every > 0}
        return {"train": True, "evaluate": every > 0 and iteration % every == 0}

    def _open_books(self) -> None:
        """Open the book of every iteration the clock lets begin (strict: only the current one)."""
        if not self.deployment.training:
            return
        while self._next_book <= self.cfg.run.iterations and self.clock.may_open(self._next_book):
            self._open_book(self._next_book, **self._plan(self._next_book))

    def _open_book(self, iteration: int, *, train: bool, evaluate: bool) -> EpisodeBook:
        # Training: iteration v's samples train the step from version v (self.start is the run's first
        # version). Without training (eval, rollout benches) every episode runs at the version held.
        target = iteration if self.deployment.training else self.clock.version
        book = EpisodeBook(iteration, target, self._episodes(iteration, target, train, evaluate))
        self.books[iteration] = book
        self._next_book = iteration + 1
        self._dispatch()
        return book

    async def rollout(self, iteration: int, *, train: bool, evaluate: bool) -> EpisodeBook:
        """Run the iteration's episodes until every one is in (or dropped); its book may have been open
        (and running) before, in bounded-staleness mode."""
        book = self.books.get(iteration) or self._open_book(iteration, train=train, evaluate=evaluate)
        self._open_books()
        await book.done.wait()
        return book

    async def step(
        self, iteration: int, checkpoint_first: bool = False, checkpoint_after: bool = False
    ) -> dict[str, dict[str, Any]]:
        """The barrier's step: TrainStep(v) to every trainer, then wait until every trainer stepped and
        every replica loaded v+1; returns each trainer's metrics. `checkpoint_first`: the trainers save
        the weights of v before they step; `checkpoint_after`: those of v+1 after it."""
        version = self.clock.begin_step()
        if version != iteration:
            raise ClockError(f"iteration {iteration} would step from version {version}")
        self._step_done.clear()
        self._send_accepted()  # (before the TrainSteps, on the same connections: the trainers have them first)
        for policy in self.policies:
            for rank in range(self.clock.ranks[policy]):
                expected = self.clock.expected_samples(policy, version, rank)
                msg = TrainStep(policy, iteration, version, expected, checkpoint_first, checkpoint_after)
                self.send_to(trainer_peer(policy, rank).encode(), msg)
        timeout_s = self.cfg.trainer.step_timeout_s
        try:
            await asyncio.wait_for(self._step_done.wait(), timeout_s)
        except TimeoutError:
            waiting = ", ".join(self.clock.waiting_for())
            raise StepTimeout(
                f"the step from version {version} did not complete within trainer.step_timeout_s={timeout_s:g}s; "
                f"no report from: {waiting}"
            ) from None
        trained = self.clock.advance()
        if self.clock.max_staleness:  # the iteration k ahead may begin now (strict: the next rollout opens it)
            self._open_books()
        self._dispatch()  # episodes waiting for this version (evaluations) may start
        return trained

    async def _iteration(self, iteration: int, *, evaluate: bool, train: bool) -> dict[str, Any]:
        t0 = time.monotonic()
        book = await self.rollout(iteration, train=train, evaluate=evaluate)
        rollout_s = book.done_at - min(t0, book.opened_at)  # stale mode: from when its first episode could run
        wait_s = time.monotonic() - t0
        if train and book.stats["train"].episodes == 0:
            raise RunFailed(f"iteration {iteration}: every training episode failed; first error: {book.first_error}")
        step_s, trained = 0.0, {}
        new_best = self._new_best(book) if evaluate and self.deployment.training else None
        if train:
            # Asked to stop (stop_request.py): checkpoint v+1 after this step and end the run there.
            stop = iteration + 1 < self.cfg.run.iterations and stop_requested(self.run_dir)
            t1 = time.monotonic()
            trained = await self.step(iteration, checkpoint_first=new_best is not None, checkpoint_after=stop)
            step_s = time.monotonic() - t1
            if new_best is not None:  # the trainers saved the evaluated weights (version v) first
                with self._writing(f"the router's checkpoint of v{book.version}", "checkpoints/router"):
                    save_router(self.run_dir, book.version, {"iteration": iteration})
            if checkpoint_due(self.cfg, self.clock.version) or stop:
                with self._writing(f"the router's checkpoint of v{self.clock.version}", "checkpoints/router"):
                    save_router(self.run_dir, self.clock.version, {"iteration": iteration + 1})
            if stop:
                self.stopped_at = self.clock.version
        if new_best is not None:  # after a final evaluation, v is the final checkpoint itself
            with self._writing("the best checkpoint's record", "checkpoints"):
                save_best(self.run_dir, book.version, new_best)
            self.best = {"version": book.version, "score": new_best}
        if self.deployment.training:
            prune_checkpoints(self.run_dir, self.policies, self.cfg.trainer.keep_checkpoints, self._starting_versions())
        await book.all_done.wait()  # the baselines, if any (each one bounded by rollout.episode_timeout_s)
        now = time.monotonic()
        row = iteration_row(
            book, eval_k=self.cfg.eval.k, train=train, trained=trained, version=book.version, rollout_s=rollout_s,
            step_s=step_s, malformed=self.malformed, refused_messages=self.refused,
            refused_handshakes=self.refusals.count, elapsed_s=now - self.started,
        )  # fmt: skip
        # The overlap of rollouts and steps: the trainers wait for the rollout (wait_s) in every mode;
        # the servers are idle while no episode runs (the step of a strict run, env-bound stretches).
        row[Keys.TRAINER_IDLE_S] = wait_s
        row[Keys.INFERENCE_IDLE_S] = self.idle.take(now, busy=any(b.generating() for b in self.books.values()))
        row.update(self.faults.take())
        row[Keys.ROUTED_REQUESTS], self.routed = self.routed, 0
        row.update(self.loop_lag.take())
        if self.leases is not None:
            row.update(self.leases.take())
        row[Keys.POISONED] = len(book.poisoned)
        untrained = self.untrained.observe(trained) if train else {}
        for policy in trained:
            row[Keys.policy(policy, "untrained_iterations")] = self.untrained.streak[policy]
        del self.books[iteration]
        with self._writing(f"the metrics row of iteration {iteration}", "metrics.jsonl"):
            self.metrics.write(row)
        for policy, why in untrained.items():
            log.warning("iteration %d: policy %s trained nothing: %s", iteration, policy, why)
        self.untrained.check(iteration, untrained)  # a named stop after trainer.max_untrained_iterations in a row
        return row

    def _writing(self, what: str, relative: str) -> contextlib.AbstractContextManager[None]:
        """A write of `what` into the run directory (at `relative`): a full disk stops the run with `DiskFull`."""
        return named_if_full(what, self.run_dir / relative, self.run_dir)

    def _starting_versions(self) -> set[int]:
        """The checkpoint this deployment's processes start from, when they do (a resumed or restarted run): a
        replica's replacement loads it, so it is kept until the next whole-run restart starts from a newer one."""
        return {self.deployment.start_version} if self.deployment.weights_paths else set()

    def _new_best(self, book: EpisodeBook) -> float | None:
        """The eval success of this iteration's weights if it beats the best so far (and is kept)."""
        if not self.cfg.trainer.keep_best or book.stats["eval"].episodes + book.dropped["eval"] == 0:
            return None
        score = book.success_rate("eval")
        return score if self.best is None or score > self.best["score"] else None

    async def cleanup(self) -> None:
        self.metrics.close()
