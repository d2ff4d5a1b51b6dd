"""A trainer's direct groups (`cluster.leases`, mas_async/training/direct_groups.py), no sockets: an episode's
Groups train only once the router accepted that attempt, from the env worker the router names, with the
count its EpisodeDone gave, in either order of arrival; anything else is refused or dropped and counted, and
the wait before a step ends in a named error when accepted groups never come. Every Groups is answered, on
its connection: held (no error), or refused and why (the worker's EpisodeDone waits for the answer)."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from mas_async.training.direct_groups import DirectGroups, MissingGroups
from mas_async.wire.messages import Accepted, Groups, GroupsReceived, Heartbeat, decode

POLICY = "vertical"


def _groups(episode: str, attempt: int = 0, iteration: int = 0, n: int = 2, policy: str = POLICY) -> Groups:
    return Groups(policy, iteration, episode, attempt, n, 10 * n, [], 1)


class _Direct(DirectGroups):
    """DirectGroups whose socket records its answers instead of sending them: (connection, answer)."""

    def __init__(self, delivered: list[Groups]) -> None:
        super().__init__(zmq.asyncio.Context.instance(), "127.0.0.1", None, POLICY, delivered.append)
        self.answers: list[tuple[bytes, GroupsReceived]] = []
        self.socket.send = lambda route, frames: self.answers.append((route, decode(frames)))  # type: ignore[method-assign]

    def errors(self) -> list[str]:
        """The errors of the answers so far ("" for groups held); the record starts again."""
        errors = [answer.error for _, answer in self.answers]
        self.answers.clear()
        return errors


def _direct() -> tuple[_Direct, list[Groups]]:
    delivered: list[Groups] = []
    return _Direct(delivered), delivered


def _accept(direct: DirectGroups, *episodes: list, iteration: int = 0) -> None:
    direct.on_accepted(Accepted(POLICY, iteration, [list(e) for e in episodes]))


def test_groups_train_once_accepted_whichever_comes_first() -> None:
    direct, delivered = _direct()
    early, late = _groups("train0-0"), _groups("train0-1")
    direct._on_message("env_worker/0", b"r", early)
    assert delivered == [] and direct.missing(0) == 0  # not accepted yet: held
    _accept(direct, ["train0-0", 0, "env_worker/0", 2], ["train0-1", 0, "env_worker/1", 2])
    assert delivered == [early] and direct.missing(0) == 1
    direct._on_message("env_worker/1", b"w1", late)
    assert delivered == [early, late] and direct.missing(0) == 0
    assert [(route, answer.episode_id, answer.error) for route, answer in direct.answers] == [
        (b"r", "train0-0", ""), (b"w1", "train0-1", "")]  # fmt: skip
    assert direct.stepped_through(0) == 0 and direct.unaccepted == 0 and direct.refused == 0


def test_an_attempt_never_accepted_is_dropped_at_its_step_and_counted() -> None:
    direct, delivered = _direct()
    direct._on_message("env_worker/0", b"r", _groups("train0-0", attempt=0, n=3))  # its worker was lost
    direct._on_message("env_worker/1", b"r", _groups("train0-0", attempt=1, n=2))
    direct._on_message("env_worker/1", b"r", _groups("train1-0", iteration=1, n=4))  # the next iteration's
    _accept(direct, ["train0-0", 1, "env_worker/1", 2])
    assert [g.attempt for g in delivered] == [1]
    assert direct.stepped_through(0) == 3 and direct.unaccepted == 3  # attempt 0's samples, never trained
    _accept(direct, ["train1-0", 0, "env_worker/1", 4], iteration=1)  # the next iteration's stays
    assert [g.iteration for g in delivered] == [0, 1]


def test_groups_from_another_worker_or_with_another_count_are_refused() -> None:
    direct, delivered = _direct()
    direct._on_message("env_worker/1", b"r", _groups("train0-0"))  # not the worker that ran it
    direct._on_message("env_worker/0", b"r", _groups("train0-0"))  # the one that did: held beside it
    _accept(direct, ["train0-0", 0, "env_worker/0", 2])
    assert len(delivered) == 1 and direct.refused == 1
    _accept(direct, ["train0-1", 0, "env_worker/0", 2])
    direct._on_message("env_worker/0", b"r", _groups("train0-1", n=3))  # not its EpisodeDone's count
    assert len(delivered) == 1 and direct.refused == 2 and direct.missing(0) == 1
    assert direct.errors() == ["", "", "its sample count is not the one its EpisodeDone gave"]


def test_groups_from_another_worker_after_the_acceptance_are_refused_and_the_named_worker_s_still_train() -> None:
    """The acceptance first, then the groups: only those of the env worker the router named train (another
    worker's copy, which a worker that was declared lost may still send, is refused and counted)."""
    direct, delivered = _direct()
    _accept(direct, ["train0-0", 1, "env_worker/0", 2])
    direct._on_message("env_worker/1", b"w1", _groups("train0-0", attempt=1))  # not the worker that ran it
    assert delivered == [] and direct.refused == 1 and direct.missing(0) == 1
    direct._on_message("env_worker/0", b"w0", _groups("train0-0", attempt=1))
    assert [(g.episode_id, g.attempt) for g in delivered] == [("train0-0", 1)] and direct.missing(0) == 0
    assert direct.errors() == ["its sender is not the env worker that ran the episode", ""]


def test_what_is_no_groups_of_this_policy_now_is_refused() -> None:
    direct, delivered = _direct()
    direct._on_message("env_worker/0", b"r", Heartbeat(0.0))
    direct._on_message("env_worker/0", b"r", _groups("train0-0", policy="horizontal"))
    direct._on_message("env_worker/0", b"r", _groups("train0-1"))
    direct._on_message("env_worker/0", b"r", _groups("train0-1"))  # the same groups again
    assert direct.refused == 3
    assert direct.errors() == ["its policy is not this trainer's", "", "its episode's groups came already"]
    direct.stepped_through(0)
    direct._on_message("env_worker/0", b"r", _groups("train0-2"))  # its iteration stepped
    _accept(direct, ["train0-2", 0, "env_worker/0", 2])
    assert delivered == [] and direct.refused == 4
    assert direct.errors() == ["its iteration has stepped"]


def test_the_wait_before_a_step_ends_when_the_groups_come_or_in_a_named_error() -> None:
    async def main() -> None:
        direct, delivered = _direct()
        _accept(direct, ["train0-0", 0, "env_worker/0", 2])
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, direct._on_message, "env_worker/0", b"r", _groups("train0-0"))
        await asyncio.wait_for(direct.wait_for(0, 5.0), 10)
        assert len(delivered) == 1
        _accept(direct, ["train1-0", 0, "env_worker/0", 2], iteration=1)
        with pytest.raises(MissingGroups, match="the groups of 1 episodes of iteration 1 .* within 0.2s"):
            await asyncio.wait_for(direct.wait_for(1, 0.2), 10)

    asyncio.run(main())
