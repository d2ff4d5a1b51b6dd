"""The router takes a message only from a peer that joined, and only of a kind its role sends; whatever
else arrives (a stranger's forged results, a worker's Trained, a Groups of a policy the run lacks, a
wrong-typed header) is dropped and counted, reaches no peer, and does not stop the router; its warnings
stay few and printable. Frames go through `_on_frames`, as from the socket."""

from __future__ import annotations

import logging

import numpy as np
import zmq

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.metrics import Keys
from mas_async.router.hub import Router
from mas_async.wire.codec import pack
from mas_async.wire.messages import (
    PROTOCOL_VERSION,
    EpisodeDone,
    Generate,
    GenerateResult,
    Groups,
    Heartbeat,
    Hello,
    Kind,
    Message,
    RunEpisode,
    Trained,
    UpdateWeights,
    WeightsLoaded,
    encode,
)
from tests.support.paths import ROOT

WORKER, TRAINER, REPLICA = b"env_worker/0", b"trainer/vertical", b"inference/vertical/0"
STRANGER = b"\x00k\x8bEg"  # what ZeroMQ makes up for a socket without an identity


class _Sent:
    def __init__(self) -> None:
        self.frames: list[list] = []

    def forget(self, identity: bytes) -> int:
        return 0  # every message left at once: nothing waits

    def send(self, frames: list) -> None:
        self.frames.append(frames)


def _router(tmp_path) -> Router:
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["env.train_size=16", "env.test_size=4"])
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 2}, {"vertical": "", "horizontal": ""})
    router = Router(config, deployment, tmp_path)
    router.io = _Sent()
    for ident, role, policy in ((WORKER, "env_worker", ""), (TRAINER, "trainer", "vertical"),
                                (REPLICA, "inference", "vertical")):  # fmt: skip
        router._on_frames(_frames(ident, Hello(role, ident.decode(), policy, 4, PROTOCOL_VERSION, 1)))
    assert len(router.io.frames) == 3 and router.refused == 0  # three Welcomes
    router.io.frames.clear()
    return router


def _frames(identity: bytes, msg: Message | list[bytes]) -> list[zmq.Frame]:
    body = encode(msg) if isinstance(msg, Message) else msg
    return [zmq.Frame(identity), *(zmq.Frame(f) for f in body)]


def _generate(policy: str = "vertical", origin: str = "env_worker/0") -> Generate:
    return Generate(1, policy, origin, 1e12, np.array([1, 2], np.int32), 1, 1, 1.0, 1.0, False, [])


def _forged() -> list[Message]:
    """One of every kind a peer sends, as a stranger would forge them."""
    return [
        _generate(),
        GenerateResult(1, "env_worker/0", "", []),
        Groups("vertical", 0, "train0-0", 0, 4, 40, []),
        EpisodeDone("train0-0", 0, "train", 0, "", {"success": 1.0}, {"vertical": 4}),
        Trained("vertical", 1, "", {}),
        UpdateWeights("vertical", 1, 0),
        WeightsLoaded("vertical", 1, "inference/vertical/0", ""),
        Heartbeat(0.0),
    ]


def test_messages_from_a_sender_that_never_joined_are_dropped_and_counted(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="mas_async.router")
    router = _router(tmp_path)
    forged = _forged()
    for _ in range(50):
        for msg in forged:
            router._on_frames(_frames(STRANGER, msg))
    assert router.refused == 50 * len(forged) and router.malformed == 0
    assert router.io.frames == []  # nothing forwarded, nothing answered
    assert STRANGER not in router.peers
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) <= len(forged) * 6  # 1st, 2nd, 4th, ..., 32nd of each kind
    assert all("\\x00k\\x8bEg" in line and "never joined" in line for line in lines)
    assert all(c.isprintable() for line in lines for c in line)


def test_each_kind_is_taken_only_from_the_role_that_sends_it(tmp_path):
    router = _router(tmp_path)
    wrong = [
        (WORKER, Trained("vertical", 1, "", {})),
        (WORKER, GenerateResult(1, "env_worker/0", "", [])),
        (WORKER, WeightsLoaded("vertical", 1, "inference/vertical/0", "")),
        (WORKER, UpdateWeights("vertical", 1, 0)),
        (REPLICA, _generate()),
        (REPLICA, Groups("vertical", 0, "train0-0", 0, 4, 40, [])),
        (TRAINER, EpisodeDone("train0-0", 0, "train", 0, "", {}, {})),
        (TRAINER, RunEpisode("train0-0", 0, "train", 0, "train1", {}, 0, 0)),  # the router's own kind
        (TRAINER, Trained("horizontal", 1, "", {})),  # not the policy it serves
        (REPLICA, WeightsLoaded("horizontal", 1, "inference/horizontal/0", "")),
        (REPLICA, GenerateResult(5, "env_worker/0", "", [])),  # answers no request it serves
    ]
    for ident, msg in wrong:
        router._on_frames(_frames(ident, msg))
    assert router.refused == len(wrong) and router.io.frames == []
    assert router.clock.version == 0  # no Trained or WeightsLoaded was taken


def test_hello_from_a_stranger_or_under_another_role_is_refused_not_fatal(tmp_path):
    router = _router(tmp_path)
    hellos = [
        (STRANGER, Hello("env_worker", "env_worker/0", "", 4, PROTOCOL_VERSION, 1)),
        (b"env_worker/99", Hello("env_worker", "env_worker/99", "", 4, PROTOCOL_VERSION + 7, 1)),  # wrong protocol
        (b"env_worker/1", Hello("trainer", "env_worker/1", "vertical", 4, PROTOCOL_VERSION, 1)),  # role of another
        (b"env_worker/1", Hello("env_worker", "env_worker/0", "", 4, PROTOCOL_VERSION, 1)),  # id of another
        (REPLICA, Hello("inference", REPLICA.decode(), "nobody", 4, PROTOCOL_VERSION, 9)),  # policy of another
    ]
    for ident, msg in hellos:
        router._on_frames(_frames(ident, msg))
    assert router.refused == len(hellos) and router.io.frames == []
    assert set(router.peers) == {WORKER, TRAINER, REPLICA}


def test_groups_of_an_unknown_policy_or_with_hostile_counts_never_reach_a_trainer(tmp_path):
    router = _router(tmp_path)
    for msg in (
        Groups("nobody", 0, "train0-0", 0, 4, 40, []),
        Groups("vertical", 0, "train0-0", 0, -4, 40, []),
        Groups("vertical", 0, "train0-0", 0, 4, 1 << 63, []),
    ):
        router._on_frames(_frames(WORKER, msg))
    assert router.refused == 3 and router.io.frames == []
    # A Groups of no current episode is late (counted by its book when there is one), never forwarded.
    router._on_frames(_frames(WORKER, Groups("vertical", 10**18, "train0-0", -1, 4, 40, [])))
    assert router.io.frames == []


def test_wrong_typed_headers_are_malformed_and_counted(tmp_path):
    router = _router(tmp_path)
    bad = [
        [bytes([Kind.GROUPS]), pack(["vertical", [0], "train0-0", 0, 4, 40]), pack([[]])],  # unhashable iteration
        [bytes([Kind.GENERATE]), pack([1, ["vertical"], "env_worker/0", 0.0]), pack([])],
        [bytes([Kind.GENERATE_RESULT]), pack([1, 5, ""]), pack([[]])],
        [bytes([Kind.HELLO]), pack(["env_worker", "x", "", 1, 1, 1]), b"\xc1"],  # payload of the decoded kinds
        [b"\xff", b"", b""],
        [b"\x0c"],
    ]
    for ident in (WORKER, STRANGER):
        for frames in bad:
            router._on_frames(_frames(ident, frames))
    assert router.malformed == 2 * len(bad) and router.refused == 0 and router.io.frames == []


def test_a_joined_worker_still_gets_an_error_reply_for_an_unknown_policy(tmp_path):
    router = _router(tmp_path)
    router._on_frames(_frames(WORKER, _generate(policy="nobody")))
    (reply,) = router.io.frames
    assert reply[0] == WORKER and router.refused == 0
    router._on_frames(_frames(WORKER, _generate()))
    assert router.io.frames[-1][0] == REPLICA  # the well-formed request is forwarded


def test_the_counters_are_in_every_row(tmp_path):
    from mas_async.router.episodes import EpisodeBook
    from mas_async.router.report import iteration_row

    row = iteration_row(
        EpisodeBook(0, 0, []), eval_k=1, train=False, trained={}, version=0, rollout_s=1.0, step_s=0.0,
        malformed=2, refused_messages=3, refused_handshakes=0, elapsed_s=1.0,
    )  # fmt: skip
    assert row[Keys.MALFORMED] == 2 and row[Keys.REFUSED_MESSAGES] == 3
