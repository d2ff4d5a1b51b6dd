"""An env worker's groups sent straight to a trainer (`cluster.leases`): it goes on to the episode's
EpisodeDone only once the trainer answered that it holds them; a refusal or no answer in
`cluster.peer_timeout_s` fails the episode with a sentence (`GroupsRefused`); a worker with no link to the
trainer sends them through the router; an answer nobody waits for is dropped."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.rollout.env_worker import EnvWorker, GroupsRefused
from mas_async.tiny_model import materialise
from mas_async.wire.messages import Groups, GroupsReceived, Message, decode, encode
from tests.support.paths import ROOT

GROUPS = Groups("vertical", 2, "train2-0", 1, 3, 12, [], 1)


class _F:
    """A received frame, as far as the worker reads it."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer


class _Trainer:
    """Stands in for a worker's link to trainer/vertical: records what is sent and answers it `reply`
    (None: never), as the trainer's socket would, one loop turn later."""

    endpoint = "tcp://127.0.0.1:1"

    def __init__(self, worker: EnvWorker, reply: str | None) -> None:
        self.worker, self.reply, self.sent = worker, reply, []

    def send(self, frames: list) -> None:
        msg = decode(frames)
        self.sent.append(msg)
        if self.reply is not None:
            answer = GroupsReceived(msg.policy, msg.iteration, msg.episode_id, msg.attempt, self.reply)
            frames = [_F(memoryview(f)) for f in encode(answer)]
            asyncio.get_running_loop().call_soon(self.worker._on_trainer, "trainer/vertical", frames)


def _worker(tmp_path: Path, reply: str | None, *overrides: str) -> tuple[EnvWorker, _Trainer, list[Message]]:
    model = str(materialise("builtin:tiny-char", tmp_path / "models"))
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["cluster.leases=true", *overrides])
    deployment = Deployment(
        "tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 2}, {"vertical": model, "horizontal": model}
    )
    worker = EnvWorker(config, deployment, 0)
    routed: list[Message] = []
    worker.send = routed.append  # type: ignore[method-assign]
    trainer = _Trainer(worker, reply)
    worker.trainers["trainer/vertical"] = trainer  # type: ignore[assignment]
    return worker, trainer, routed


def test_the_worker_goes_on_once_the_trainer_holds_the_groups(tmp_path):
    worker, trainer, routed = _worker(tmp_path, "")
    asyncio.run(asyncio.wait_for(worker._send_groups(GROUPS, 0), 10))
    assert trainer.sent == [GROUPS] and routed == [] and worker._received == {}


def test_a_refusal_or_no_answer_fails_the_episode_with_a_sentence(tmp_path):
    worker, trainer, _ = _worker(tmp_path, "its policy is not this trainer's")
    with pytest.raises(GroupsRefused, match="trainer/vertical refused the episode's groups: its policy is not"):
        asyncio.run(asyncio.wait_for(worker._send_groups(GROUPS, 0), 10))
    worker, trainer, _ = _worker(tmp_path, None, "cluster.peer_timeout_s=0.2")
    with pytest.raises(GroupsRefused, match="trainer/vertical did not confirm the episode's groups within 0.2s"):
        asyncio.run(asyncio.wait_for(worker._send_groups(GROUPS, 0), 10))
    assert len(trainer.sent) == 1 and worker._received == {}


def test_without_a_link_to_the_trainer_the_groups_go_through_the_router(tmp_path):
    worker, trainer, routed = _worker(tmp_path, "")
    asyncio.run(asyncio.wait_for(worker._send_groups(GROUPS, 1), 10))  # trainer/vertical/1: no link
    assert routed == [GROUPS] and trainer.sent == []


def test_an_answer_nobody_waits_for_is_dropped(tmp_path):
    worker, _, _ = _worker(tmp_path, "")
    stray = encode(GroupsReceived("vertical", 2, "train2-0", 1, ""))
    worker._on_trainer("trainer/vertical", [_F(memoryview(f)) for f in stray])
    worker._on_trainer("trainer/vertical", [_F(memoryview(b"\x63")), _F(memoryview(b"x")), _F(memoryview(b""))])
    assert worker._received == {} and worker.malformed == 1
