"""Group-relative advantages: hand-computed values for each grouping, and groups that never merge."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mas_async.training.advantages import compute_advantages
from mas_async.wire.samples import Sample

S = math.sqrt(2 / 3)  # population std of [1, 0, -1] and of [0, 1, 2]
EPS = 1e-6


def sample(episode: str, agent: str, turn: int, reward: float, problem: str = "p0", ret: float = 0.0) -> Sample:
    return Sample(
        group=f"{episode}/{agent}/{turn}",
        episode_id=episode,
        problem_id=problem,
        agent=agent,
        policy="pi",
        turn=turn,
        prompt_ids=np.zeros(2, dtype=np.int32),
        completion_ids=np.zeros(1, dtype=np.int32),
        logprobs=np.zeros(1, dtype=np.float32),
        version=0,
        reward=reward,
        episode_return=ret,
    )


def batch() -> list[Sample]:
    return [
        sample("e1", "v", 0, 1.0),
        sample("e1", "v", 0, 0.0),
        sample("e1", "v", 0, -1.0),
        sample("e1", "h", 0, 2.0),  # a group of one
        sample("e1", "v", 1, 3.0),
        sample("e1", "v", 1, 1.0),
        sample("e2", "v", 0, 2.0),
        sample("e2", "v", 0, 2.0),  # equal rewards: std 0
    ]


def test_agent_turn_hand_computed() -> None:
    got = compute_advantages(batch(), "agent_turn", eps=EPS)
    expected = [1 / (S + EPS), 0.0, -1 / (S + EPS), 0.0, 1 / (1 + EPS), -1 / (1 + EPS), 0.0, 0.0]
    assert got.dtype == np.float32 and got.shape == (8,)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_agent_turn_without_std() -> None:
    got = compute_advantages(batch(), "agent_turn", normalize_std=False)
    np.testing.assert_allclose(got, [1.0, 0.0, -1.0, 0.0, 1.0, -1.0, 0.0, 0.0])


def test_agent_grouping_hand_computed() -> None:
    # Agent v of problem p0: rewards [1, 0, -1, 3, 1, 2, 2], mean 8/7; agent h: one sample.
    rewards = np.array([1.0, 0.0, -1.0, 3.0, 1.0, 2.0, 2.0])
    mean, std = rewards.mean(), math.sqrt(((rewards - 8 / 7) ** 2).sum() / 7)
    v = (rewards - mean) / (std + EPS)
    got = compute_advantages(batch(), "agent", eps=EPS)
    np.testing.assert_allclose(got, [v[0], v[1], v[2], 0.0, v[3], v[4], v[5], v[6]], rtol=1e-5)
    np.testing.assert_allclose(compute_advantages(batch(), "agent", normalize_std=False)[:3], rewards[:3] - 8 / 7)


def test_trajectory_grouping_hand_computed() -> None:
    # Problem p0: episodes a (return 1, two samples), b (return 0, three), c (return 2, one): each
    # episode counts once, so the mean is 1 and the std sqrt(2/3). Problem p1 has a single episode.
    samples = [
        sample("a", "v", 0, 9.0, ret=1.0),
        sample("b", "v", 0, 9.0, ret=0.0),
        sample("a", "h", 0, -9.0, ret=1.0),
        sample("c", "v", 0, 9.0, ret=2.0),
        sample("b", "h", 0, 9.0, ret=0.0),
        sample("b", "v", 1, 9.0, ret=0.0),
        sample("d", "v", 0, 9.0, problem="p1", ret=5.0),
    ]
    got = compute_advantages(samples, "trajectory", eps=EPS)
    b, c = -1 / (S + EPS), 1 / (S + EPS)
    np.testing.assert_allclose(got, [0.0, b, 0.0, c, b, b, 0.0], rtol=1e-6)
    np.testing.assert_allclose(
        compute_advantages(samples, "trajectory", normalize_std=False), [0, -1, 0, 1, -1, -1, 0], atol=1e-7
    )


def test_mixed_problems_equal_per_problem_even_with_colliding_episode_ids() -> None:
    # Both problems have episodes named "e" and "f"; the samples of an episode share its return.
    p0 = [sample("e", "v", 0, 1.0, "p0", ret=1.0), sample("e", "v", 0, 0.0, "p0", ret=1.0)]
    p0 += [sample("f", "v", 0, 4.0, "p0", ret=4.0)]
    p1 = [sample("e", "v", 0, 5.0, "p1", ret=5.0), sample("e", "v", 0, 9.0, "p1", ret=5.0)]
    p1 += [sample("f", "v", 0, 7.0, "p1", ret=2.0)]
    mixed = [s for pair in zip(p0, p1, strict=True) for s in pair]
    for grouping in ("agent_turn", "agent", "trajectory"):
        together = compute_advantages(mixed, grouping)
        np.testing.assert_array_equal(together[0::2], compute_advantages(p0, grouping))
        np.testing.assert_array_equal(together[1::2], compute_advantages(p1, grouping))


def test_unknown_grouping_names_the_choices() -> None:
    with pytest.raises(ValueError, match="'turn'.*agent_turn, agent, trajectory"):
        compute_advantages(batch(), "turn")


def test_empty_batch_and_inconsistent_returns() -> None:
    assert compute_advantages([], "trajectory").shape == (0,)
    with pytest.raises(ValueError, match="different returns"):
        compute_advantages([sample("a", "v", 0, 0.0, ret=1.0), sample("a", "h", 0, 0.0, ret=2.0)], "trajectory")
