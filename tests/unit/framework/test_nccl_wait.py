"""A weight broadcast is waited for by polling `Work.is_completed()` against the group's bound, never with a
timed `Work.wait(timeout)`: on an NCCL group that call aborts the communicator once the timeout has passed
since the work started, and rethrows (PyTorch's `WorkNCCL::wait` -> `checkTimeout` -> `abort()`), so any
broadcast longer than one poll would end the weight group. Fakes stand in for the NCCL process group and
its work objects (no GPU here); they fail the test the moment a timed wait is called."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mas_async.weights.group import POLL_S, GroupRetired, WeightGroup, WeightSyncError

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run one at a time (make test)


class TimedWaitCalled(AssertionError):
    """What `WorkNCCL::wait(timeout)` would have done to a real group: abort it."""


class FakeNcclWork:
    """A broadcast that completes after `seconds` (never when None); records every wait."""

    def __init__(self, seconds: float | None, error: str | None = None) -> None:
        self.done_at = None if seconds is None else time.monotonic() + seconds
        self.error = error
        self.waits: list[object] = []
        self.polls = 0

    def is_completed(self) -> bool:
        self.polls += 1
        return self.done_at is not None and time.monotonic() >= self.done_at

    def wait(self, timeout: object = None) -> bool:
        self.waits.append(timeout)
        if timeout is not None:
            raise TimedWaitCalled(f"a timed wait ({timeout}) on an NCCL work: the communicator would be aborted")
        assert self.is_completed(), "an untimed wait on a running NCCL work blocks until it completes"
        if self.error:
            raise RuntimeError(self.error)
        return True


class FakeNcclGroup:
    def __init__(self, work: FakeNcclWork) -> None:
        self.work = work
        self.aborted = False

    def broadcast(self, tensors: list[torch.Tensor], opts: object) -> FakeNcclWork:
        return self.work

    def abort(self) -> None:
        self.aborted = True


def _group(work: FakeNcclWork, timeout_s: float = 30.0, rank: int = 0) -> tuple[WeightGroup, FakeNcclGroup]:
    pg = FakeNcclGroup(work)
    group = WeightGroup(
        policy="vertical", backend="nccl", rank=rank, world_size=2, device=torch.device("cpu"),
        pg=pg, store=None, timeout_s=timeout_s,  # type: ignore[arg-type]
    )  # fmt: skip
    return group, pg


def test_a_broadcast_longer_than_a_poll_completes_without_a_timed_wait() -> None:
    work = FakeNcclWork(seconds=3 * POLL_S)
    group, pg = _group(work)
    started = time.monotonic()
    group.broadcast(torch.zeros(4), "bucket 1 of 1 of v1")
    took = time.monotonic() - started
    assert work.waits == [None]  # one untimed wait, once complete
    assert 3 * POLL_S <= took < 3 * POLL_S + 0.1  # noticed within a short spin, not a whole poll
    assert not pg.aborted


def test_a_short_broadcast_is_noticed_at_once() -> None:
    work = FakeNcclWork(seconds=0.0)
    group, _ = _group(work)
    started = time.monotonic()
    group.broadcast(torch.zeros(4))
    assert time.monotonic() - started < 0.05 and work.waits == [None]


def test_a_broadcast_that_never_completes_ends_at_the_bound_with_a_named_error() -> None:
    work = FakeNcclWork(seconds=None)
    group, _ = _group(work, timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"\(nccl\): bucket 2 of 3 of v5 did not complete within 0.5 s, waiting "
                       r"for its inference replicas \(ranks 1..1\): the nccl work was not complete after 0.5 s"):  # fmt: skip
        group.broadcast(torch.zeros(4), "bucket 2 of 3 of v5")
    assert 0.5 <= time.monotonic() - started < 1.0
    assert work.waits == [] and work.polls > 10


def test_the_operation_s_own_error_is_raised_from_the_untimed_wait() -> None:
    work = FakeNcclWork(seconds=0.05, error="NCCL error: remote process exited")
    group, _ = _group(work)
    with pytest.raises(WeightSyncError, match="remote process exited"):
        group.broadcast(torch.zeros(4))
    assert work.waits == [None]


def test_a_retired_group_ends_the_wait_within_a_poll() -> None:
    work = FakeNcclWork(seconds=None)
    group, pg = _group(work)
    threading.Timer(0.3, group.retire).start()
    started = time.monotonic()
    with pytest.raises(GroupRetired, match="was abandoned"):
        group.broadcast(torch.zeros(4))
    assert time.monotonic() - started < 0.3 + POLL_S + 0.1
    assert work.waits == [] and pg.aborted  # retiring an NCCL group aborts its communicator, on purpose
