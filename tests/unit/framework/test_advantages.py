"""Group-relative advantages: hand-computed values for each grouping and std scope, and groups that never merge."""

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
    for grouping, scope in [
        ("agent_turn", "group"),
        ("agent_turn", "agent"),
        ("agent", "group"),
        ("trajectory", "group"),
    ]:
        together = compute_advantages(mixed, grouping, std_scope=scope)
        np.testing.assert_array_equal(together[0::2], compute_advantages(p0, grouping, std_scope=scope))
        np.testing.assert_array_equal(together[1::2], compute_advantages(p1, grouping, std_scope=scope))


def routed_verifier_episode() -> list[Sample]:
    """The verifier's candidates in one tree-sampled episode of the routed math env (alpha = 1):
    r = team_reward (1 when the proposed answer is correct) + local (1 when the verdict is right).
    Turn 0: the solver's answer is wrong (team 0): one REJECT (right: r = 1), three APPROVE (r = 0).
    Turn 1: the solver's new answer is correct (team 1): three APPROVE (r = 2), one REJECT (wrong: r = 1).
    The solver's own candidates are in the batch too, on another scale."""
    verifier = [1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 1.0]
    samples = [sample("e", "verifier", i // 4, r) for i, r in enumerate(verifier)]
    solver = [0.0, 0.0, 0.0, 0.0, 2.0, 2.0, 0.0, 0.0]  # turn 0: all wrong; turn 1: two correct (team 1 + local 1)
    return samples + [sample("e", "solver", i // 4, r) for i, r in enumerate(solver)]


def test_agent_std_scope_keeps_the_turn_baseline_routed_math() -> None:
    samples = routed_verifier_episode()
    right_reject, wrong_reject = 0, 7
    # Pooling the agent's turns (grouping=agent) credits both REJECTs with the pooled mean 1: advantage 0.
    pooled = compute_advantages(samples, "agent")
    assert pooled[right_reject] == 0.0 and pooled[wrong_reject] == 0.0
    got = compute_advantages(samples, "agent_turn", eps=EPS, std_scope="agent")
    # Verifier residuals: turn 0 [.75, -.25, -.25, -.25], turn 1 [.25, .25, .25, -.75]; sigma_v = sqrt(3/16).
    sigma_v = math.sqrt(3 / 16)
    v = np.array([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75]) / (sigma_v + EPS)
    # Solver residuals: turn 0 all 0, turn 1 [1, 1, -1, -1]; sigma_s = sqrt(4/8).
    s = np.array([0, 0, 0, 0, 1.0, 1.0, -1.0, -1.0]) / (math.sqrt(0.5) + EPS)
    np.testing.assert_allclose(got, np.concatenate([v, s]), rtol=1e-6, atol=1e-7)
    assert got[right_reject] > 1.7 and got[wrong_reject] < -1.7


def test_agent_std_scope_uses_each_agents_own_sigma() -> None:
    # Agent "a" acts at two turns with different spreads, agent "b" at two turns on its own scale.
    a = [sample("e", "a", 0, r) for r in (0.0, 2.0)] + [sample("e", "a", 1, r) for r in (5.0, 5.5, 6.0, 6.5)]
    b = [sample("e", "b", 0, r) for r in (0.0, 0.1)] + [sample("e", "b", 1, r) for r in (0.3, 0.3, 0.3, 0.5)]
    got = compute_advantages(a + b, "agent_turn", eps=EPS, std_scope="agent")
    res_a = np.array([-1.0, 1.0, -0.75, -0.25, 0.25, 0.75])
    res_b = np.array([-0.05, 0.05, -0.05, -0.05, -0.05, 0.15])
    sigma_a, sigma_b = np.sqrt(np.mean(res_a**2)), np.sqrt(np.mean(res_b**2))
    assert sigma_a > 5 * sigma_b
    np.testing.assert_allclose(got, np.concatenate([res_a / (sigma_a + EPS), res_b / (sigma_b + EPS)]), rtol=1e-5)
    # Unit root mean square per agent: each agent's gradient on one scale, as Dr. MAS asks.
    np.testing.assert_allclose([np.sqrt(np.mean(got[:6] ** 2)), np.sqrt(np.mean(got[6:] ** 2))], 1.0, rtol=1e-4)
    # Within an agent the scale is shared, not per group: a's wide turn-0 group outweighs its narrow turn 1,
    # where std_scope=group would make both unit std.
    assert abs(got[1]) > abs(got[5]) and compute_advantages(a, "agent_turn")[1] == pytest.approx(1.0, rel=1e-5)
    # Scaling (and shifting) agent a's rewards changes neither agent b's advantages nor a's own.
    scaled = [sample("e", "a", s.turn, 100.0 * s.reward + 7.0) for s in a]
    again = compute_advantages(scaled + b, "agent_turn", eps=EPS, std_scope="agent")
    np.testing.assert_array_equal(again[6:], got[6:])
    np.testing.assert_allclose(again[:6], got[:6], rtol=1e-5)


def test_agent_std_scope_is_per_problem_and_skips_groups_of_one() -> None:
    p0 = [sample("e", "a", 0, r, "p0") for r in (0.0, 1.0)] + [sample("e", "a", 1, 9.0, "p0")]  # a group of one
    p1 = [sample("e", "a", 0, r, "p1") for r in (0.0, 10.0)]
    got = compute_advantages(p0 + p1, "agent_turn", eps=EPS, std_scope="agent")
    # p0: residuals [-.5, .5], sigma .5 (the group of one neither gets an advantage nor dilutes sigma).
    np.testing.assert_allclose(got, [-1.0, 1.0, 0.0, -1.0, 1.0], rtol=1e-5)
    np.testing.assert_array_equal(got[:3], compute_advantages(p0, "agent_turn", eps=EPS, std_scope="agent"))
    # Without std normalisation the scope does not matter; equal rewards give 0, not NaN.
    np.testing.assert_allclose(
        compute_advantages(p0, "agent_turn", normalize_std=False, std_scope="agent"), [-0.5, 0.5, 0.0]
    )
    ties = [sample("e", "a", 0, 3.0), sample("e", "a", 0, 3.0)]
    np.testing.assert_array_equal(compute_advantages(ties, "agent_turn", std_scope="agent"), [0.0, 0.0])


def test_agent_std_scope_needs_agent_turn_groups() -> None:
    with pytest.raises(ValueError, match="std_scope 'agent'.*'trajectory'"):
        compute_advantages(batch(), "trajectory", std_scope="agent")
    with pytest.raises(ValueError, match="std_scope 'agent'.*'agent'"):
        compute_advantages(batch(), "agent", std_scope="agent")
    with pytest.raises(ValueError, match="'problem'.*group, agent"):
        compute_advantages(batch(), "agent_turn", std_scope="problem")


def test_unknown_grouping_names_the_choices() -> None:
    with pytest.raises(ValueError, match="'turn'.*agent_turn, agent, trajectory"):
        compute_advantages(batch(), "turn")


def test_empty_batch_and_inconsistent_returns() -> None:
    assert compute_advantages([], "trajectory").shape == (0,)
    with pytest.raises(ValueError, match="different returns"):
        compute_advantages([sample("a", "v", 0, 0.0, ret=1.0), sample("a", "h", 0, 0.0, ret=2.0)], "trajectory")
