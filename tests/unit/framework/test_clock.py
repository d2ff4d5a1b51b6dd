"""The version clock: which samples a step accepts (strict, and the window of bounded staleness), when
an iteration's episodes may run, when a step is due, and that a trainer or replica reporting another
version is a named error."""

from __future__ import annotations

import pytest

from mas_async.router.clock import ClockError, VersionClock


def _clock(start: int = 0, k: int = 0) -> VersionClock:
    loads = [("a", "inference/a/0"), ("b", "inference/b/0"), ("b", "inference/b/1")]
    return VersionClock(["a", "b"], loads, start, k)


def _complete_step(clock: VersionClock) -> None:
    version = clock.begin_step() + 1
    for policy in clock.policies:
        clock.trained(policy, version, {})
    for policy, replica in clock.loads:
        clock.loaded(policy, replica, version)
    clock.advance()


def test_strict_accepts_only_samples_of_the_held_version():
    clock = _clock()
    assert clock.accepts(4, step_version=4)
    assert not clock.accepts(3, step_version=4)  # older: stale
    assert not clock.accepts(5, step_version=4)  # newer: not yet held


@pytest.mark.parametrize("k", [1, 2, 3])
def test_bounded_staleness_accepts_exactly_the_window(k):
    clock = _clock(k=k)
    accepted = [v for v in range(0, 12) if clock.accepts(v, step_version=8)]
    assert accepted == list(range(8 - k, 9))


def test_strict_episodes_wait_for_their_version_and_for_no_step():
    clock = _clock(start=3)
    assert clock.may_dispatch(3) and clock.may_dispatch(3, "eval")
    assert not clock.may_open(4) and not clock.may_dispatch(4)
    clock.begin_step()
    assert not clock.may_dispatch(3) and not clock.may_dispatch(3, "eval")


def test_stale_training_episodes_run_up_to_k_iterations_ahead_even_during_a_step():
    clock = _clock(start=3, k=2)
    assert [t for t in range(3, 9) if clock.may_open(t)] == [3, 4, 5]
    clock.begin_step()  # rollouts keep going while the trainers step
    assert clock.may_dispatch(5) and not clock.may_dispatch(6)
    # evaluation measures the weights of its own iteration, never older ones
    assert not clock.may_dispatch(4, "eval") and not clock.may_dispatch(3, "eval")
    clock.trained("a", 4, {})
    clock.trained("b", 4, {})
    for policy, replica in clock.loads:
        clock.loaded(policy, replica, 4)
    clock.advance()
    assert clock.may_dispatch(6) and clock.may_dispatch(4, "eval") and not clock.may_dispatch(7)


def test_forwarded_counts_are_forgotten_once_their_step_is_done():
    clock = _clock(start=3, k=1)
    clock.forwarded("a", 3, 5)
    clock.forwarded("a", 4, 7)  # the next iteration, running ahead
    _complete_step(clock)
    assert clock.expected_samples("a", 3) == 0 and clock.expected_samples("a", 4) == 7


def test_a_step_is_due_only_when_every_episode_is_in():
    clock = _clock()
    assert not clock.step_due(in_flight=1, queued=0)
    assert not clock.step_due(in_flight=0, queued=2)
    assert clock.step_due(in_flight=0, queued=0)
    clock.begin_step()
    assert not clock.step_due(in_flight=0, queued=0) and not clock.may_dispatch(0)


def test_samples_are_counted_per_policy_and_version():
    clock = _clock(3)
    clock.forwarded("a", 3, 8)
    clock.forwarded("a", 3, 4)
    clock.forwarded("b", 3, 2)
    clock.forwarded("a", 2, 99)  # another version's count never mixes in
    assert clock.expected_samples("a", 3) == 12 and clock.expected_samples("b", 3) == 2
    assert clock.expected_samples("b", 4) == 0


def test_the_step_completes_when_every_trainer_stepped_and_every_replica_loaded():
    clock = _clock(3)
    assert clock.begin_step() == 3
    clock.trained("a", 4, {"loss": 1.0})
    clock.loaded("a", "inference/a/0", 4)
    clock.trained("b", 4, {})
    clock.loaded("b", "inference/b/0", 4)
    assert not clock.step_complete()  # inference/b/1 has not loaded v4
    clock.loaded("b", "inference/b/1", 4)
    assert clock.step_complete()
    assert clock.advance() == {"a": {"loss": 1.0}, "b": {}}
    assert clock.version == 4 and clock.may_dispatch(4) and not clock.step_complete()


def test_a_wrong_version_or_a_report_outside_a_step_is_a_named_error():
    clock = _clock(3)
    with pytest.raises(ClockError, match="no step in progress"):
        clock.trained("a", 4, {})
    clock.begin_step()
    with pytest.raises(ClockError, match="reports version 5, expected 4"):
        clock.loaded("a", "inference/a/0", 5)
    with pytest.raises(ClockError, match="unknown policy"):
        clock.trained("zzz", 4, {})
    with pytest.raises(ClockError, match="not complete"):
        clock.advance()
    with pytest.raises(ClockError, match="already in progress"):
        clock.begin_step()


def test_trainer_ranks_get_whole_episodes_balanced_by_tokens_and_all_must_report():
    clock = VersionClock(["a", "b"], [("a", "inference/a/0")], ranks={"a": 2})
    assert clock.least_loaded_rank("a", 0) == 0 and clock.least_loaded_rank("b", 0) == 0
    clock.forwarded("a", 0, 4, rank=0, tokens=100)
    assert clock.least_loaded_rank("a", 0) == 1
    clock.forwarded("a", 0, 2, rank=1, tokens=30)
    clock.forwarded("a", 0, 2, rank=1, tokens=30)
    assert clock.least_loaded_rank("a", 0) == 1  # 60 < 100 tokens
    clock.forwarded("a", 0, 4, rank=1, tokens=50)
    assert clock.least_loaded_rank("a", 0) == 0
    assert [clock.expected_samples("a", 0, r) for r in (0, 1)] == [4, 8]
    clock.begin_step()
    clock.trained("a", 1, {"loss": 1.0}, rank=0)
    clock.trained("b", 1, {})
    clock.loaded("a", "inference/a/0", 1)
    assert not clock.step_complete()  # rank 1 of "a" has not reported
    with pytest.raises(ClockError, match="rank 2 of 'a', which has 2 ranks"):
        clock.trained("a", 1, {}, rank=2)
    clock.trained("a", 1, {}, rank=1)
    assert clock.advance() == {"a": {"loss": 1.0}, "b": {}}
    assert clock.expected_samples("a", 0, 1) == 0 and clock.least_loaded_rank("a", 1) == 0


def test_a_replica_that_serves_two_policies_loads_each_ones_version():
    clock = VersionClock(["a", "b"], [("a", "inference/a/0"), ("b", "inference/a/0")])
    clock.begin_step()
    clock.trained("a", 1, {})
    clock.trained("b", 1, {})
    clock.loaded("a", "inference/a/0", 1)
    assert not clock.step_complete()  # b's adapters are not loaded on the shared server yet
    assert clock.waiting_for() == ["inference/a/0 for 'b'"]
    with pytest.raises(ClockError, match="inference/a/0 for 'b' reports version 2"):
        clock.loaded("b", "inference/a/0", 2)
    clock.loaded("b", "inference/a/0", 1)
    assert clock.step_complete()
