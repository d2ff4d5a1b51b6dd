"""An inference replica's direct socket (`cluster.leases`) with real sockets on 127.0.0.1 and no processes:
the real `DirectRequests` (CURVE server with the replica's own key, ZAP admitting env workers only) against
the env worker's real `DirectLink`s and a raw DEALER. A worker's request is taken and answered on its own
connection; a request whose origin is another worker than the connection's, a message that is no request
and one that does not decode are dropped and counted; a process of the run that is no env worker (a
trainer's key) is refused at the handshake; without CURVE the same origin check holds on the socket
identity. A trainer's direct socket (`DirectGroups`) delivers an episode's Groups sent over real links only
from the worker the router named, and refuses a replica's key at the handshake."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import uvloop
import zmq
import zmq.asyncio

from mas_async.config import load_config
from mas_async.inference.direct import DirectRequests
from mas_async.rollout.direct_link import DirectLink
from mas_async.runtime.curve import secure_client
from mas_async.training.direct_groups import DirectGroups
from mas_async.wire.messages import (
    Accepted,
    Generate,
    GenerateResult,
    Groups,
    GroupsReceived,
    Heartbeat,
    decode,
    encode,
)
from tests.support.paths import ROOT
from tests.support.run_keys import issue_keys, until

WAIT_S = 5.0
"""Bound of every wait in these tests; each normally takes milliseconds."""
REPLICA = "inference/vertical/0"
TRAINER = "trainer/vertical"
NAMES = ["router", TRAINER, "env_worker/0", "env_worker/1", REPLICA]


def _keys(run_dir: Path) -> tuple[str, dict[str, str]]:
    return issue_keys(load_config(ROOT / "configs/plan_path_tiny.yaml"), run_dir, NAMES)


def _generate(request_id: int, origin: str) -> Generate:
    return Generate(request_id, "vertical", origin, time.time() + 60, np.arange(3, dtype=np.int32), 1, 4, 1.0, 1.0,
                    False, [])  # fmt: skip


async def _until(condition, what: str) -> None:
    await until(condition, what, WAIT_S)


class _Side:
    """The replica's direct socket in a context of its own, answering every request it takes at once, and the
    env workers' links in another; every task supervised (none may have failed) and torn down at the end."""

    def __init__(self, keys_dir: str | None, secrets: dict[str, str]) -> None:
        self.keys_dir, self.secrets = keys_dir, secrets
        self.tasks: list[asyncio.Task] = []
        self.replica_ctx, self.worker_ctx = zmq.asyncio.Context(), zmq.asyncio.Context()
        self.taken: list[Generate] = []
        self.results: list[tuple[str, int]] = []
        self.direct = DirectRequests(self.replica_ctx, "127.0.0.1", keys_dir, self._answer, secrets.get(REPLICA))

    def spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.append(task)
        return task

    def _answer(self, msg: Generate) -> None:
        self.taken.append(msg)
        assert self.direct.reply(msg, GenerateResult(msg.request_id, msg.origin, "", []))

    def link(self, worker: str) -> DirectLink:
        def on_frames(replica: str, frames: list) -> None:
            result = decode([f.buffer for f in frames])
            assert isinstance(result, GenerateResult) and replica == REPLICA
            self.results.append((worker, result.request_id))

        return DirectLink(self.worker_ctx, REPLICA, self.direct.endpoint, worker=worker, keys_dir=self.keys_dir,
                           on_frames=on_frames, spawn=self.spawn, secret=self.secrets.get(worker))  # fmt: skip

    def close(self) -> None:
        failed = [t for t in self.tasks if t.done() and not t.cancelled() and t.exception()]
        for task in self.tasks:
            task.cancel()
        self.worker_ctx.destroy(linger=0)
        self.replica_ctx.destroy(linger=0)
        assert not failed, failed[0].exception()


def test_a_worker_s_request_is_answered_on_its_connection_and_one_in_another_s_name_is_refused(tmp_path):
    keys_dir, secrets = _keys(tmp_path / "run")

    async def main() -> None:
        side = _Side(keys_dir, secrets)
        try:
            assert side.direct.start(side.spawn).startswith("tcp://127.0.0.1:")
            first, second = side.link("env_worker/0"), side.link("env_worker/1")
            first.send(encode(_generate(1, "env_worker/0")))
            second.send(encode(_generate(1, "env_worker/1")))  # the same request id, another worker
            await _until(lambda: len(side.results) == 2, "both answered")
            assert sorted(side.results) == [("env_worker/0", 1), ("env_worker/1", 1)]  # each on its own connection
            first.send(encode(_generate(2, "env_worker/1")))  # env_worker/0's key, env_worker/1's name
            await _until(lambda: side.direct.refused == 1, "the request in another worker's name refused")
            first.send([b"\x63", b"garbage", b""])  # undecodable: dropped and counted
            first.send(encode(Heartbeat(0.0)))  # no request: dropped and counted
            await _until(lambda: side.direct.malformed == 1 and side.direct.refused == 2, "both dropped")
            first.send(encode(_generate(3, "env_worker/0")))
            await _until(lambda: len(side.results) == 3, "its own request still served")
            taken = sorted((m.origin, m.request_id) for m in side.taken)
            assert taken == [("env_worker/0", 1), ("env_worker/0", 3), ("env_worker/1", 1)]
            assert side.direct.taken == 3
            assert ("env_worker/1", 2) not in side.results and ("env_worker/0", 2) not in side.results
        finally:
            side.close()

    uvloop.run(main())


def test_a_key_of_the_run_that_is_no_env_worker_s_is_refused_at_the_handshake(tmp_path):
    keys_dir, secrets = _keys(tmp_path / "run")

    async def main() -> None:
        side = _Side(keys_dir, secrets)
        sock = side.worker_ctx.socket(zmq.DEALER)
        try:
            side.direct.start(side.spawn)
            secure_client(sock, keys_dir, secrets["trainer/vertical"], server=REPLICA)  # the right replica key
            sock.connect(side.direct.endpoint)
            await sock.send_multipart(encode(_generate(1, "trainer/vertical")))
            await _until(lambda: side.direct.refusals.count >= 1, "the trainer's handshake refused")
            assert await sock.poll(200) == 0 and side.taken == [] and side.direct.refused == 0
            worker = side.link("env_worker/0")  # an env worker is served meanwhile
            worker.send(encode(_generate(2, "env_worker/0")))
            await _until(lambda: side.results == [("env_worker/0", 2)], "the env worker served")
        finally:
            sock.close(linger=0)
            side.close()

    uvloop.run(main())


def test_without_curve_the_origin_is_checked_against_the_socket_identity(tmp_path):
    async def main() -> None:
        side = _Side(None, {})
        try:
            side.direct.start(side.spawn)
            link = side.link("env_worker/0")  # its identity is its name
            link.send(encode(_generate(1, "env_worker/1")))
            await _until(lambda: side.direct.refused == 1, "the request in another worker's name refused")
            link.send(encode(_generate(2, "env_worker/0")))
            await _until(lambda: side.results == [("env_worker/0", 2)], "its own request served")
        finally:
            side.close()

    uvloop.run(main())


def test_a_trainer_takes_an_episode_s_groups_from_the_worker_the_router_named_only(tmp_path):
    keys_dir, secrets = _keys(tmp_path / "run")

    async def main() -> None:
        side = _Side(keys_dir, secrets)
        delivered: list[Groups] = []
        trainer = DirectGroups(side.replica_ctx, "127.0.0.1", keys_dir, "vertical", delivered.append, secrets[TRAINER])
        replica_sock = side.worker_ctx.socket(zmq.DEALER)
        try:
            trainer.start(side.spawn)

            answers: list[tuple[str, GroupsReceived]] = []

            def link(worker: str) -> DirectLink:
                def on_frames(name: str, frames: list) -> None:
                    assert name == TRAINER
                    answers.append((worker, decode([f.buffer for f in frames])))

                return DirectLink(side.worker_ctx, TRAINER, trainer.socket.endpoint, worker=worker, keys_dir=keys_dir,
                                  on_frames=on_frames, spawn=side.spawn, secret=secrets[worker])  # fmt: skip

            groups = Groups("vertical", 0, "train0-0", 0, 1, 4, [], 1)
            link("env_worker/1").send(encode(groups))  # not the worker that ran it: held, never delivered
            first = link("env_worker/0")
            first.send(encode(groups))
            first.send(encode(Groups("horizontal", 0, "train0-0", 0, 1, 4, [], 1)))
            await _until(lambda: len(answers) == 3, "every Groups answered, on its own connection")
            assert sorted((w, a.policy, a.error) for w, a in answers) == [
                ("env_worker/0", "horizontal", "its policy is not this trainer's"),
                ("env_worker/0", "vertical", ""), ("env_worker/1", "vertical", "")]  # fmt: skip
            assert len(trainer.arrived[(0, "train0-0", 0)]) == 2
            trainer.on_accepted(Accepted("vertical", 0, [["train0-0", 0, "env_worker/0", 1]]))
            assert [g.episode_id for g in delivered] == ["train0-0"] and trainer.refused == 2
            secure_client(replica_sock, keys_dir, secrets[REPLICA], server=TRAINER)  # a replica's key: refused
            replica_sock.connect(trainer.socket.endpoint)
            await replica_sock.send_multipart(encode(Groups("vertical", 0, "train0-1", 0, 1, 4, [], 1)))
            await _until(lambda: trainer.socket.refusals.count >= 1, "the replica's handshake refused")
            assert (0, "train0-1", 0) not in trainer.arrived
        finally:
            replica_sock.close(linger=0)
            side.close()

    uvloop.run(main())
