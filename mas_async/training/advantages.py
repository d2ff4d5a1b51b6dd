"""Group-relative advantages for GRPO-style training: the groupings and std scopes of the ablations.

Notation: r_i is the reward sample i is credited with, k its agent, g its (episode, agent, turn) group of K
candidates (`Sample.group`: one agent, one state), mu_g and sigma_g the mean and population std (ddof=0) of
the rewards of g. Every statistic is also keyed by problem, so two problems never share one, even if their
episode ids were to collide; and a group of one gets advantage 0.

- grouping="agent_turn", std_scope="group" (AT-GRPO, the default):
      A_i = (r_i - mu_g) / (sigma_g + eps)
- grouping="agent_turn", std_scope="agent" (AT-GRPO's baseline with Dr. MAS's per-agent scale):
      A_i = (r_i - mu_g) / (sigma_k + eps),   sigma_k = sqrt(mean_{j of agent k} (r_j - mu_g(j))^2)
  over agent k's samples of the problem that sit in groups of two or more. The baseline stays the
  state's own: rewards are only ever compared with candidates from the same state, so a term that is
  constant within a turn but differs between turns (alpha * team_reward) never leaks into it. The scale
  is agent k's own, as Dr. MAS asks: whatever agent k's reward scale, its advantages have unit root mean
  square over the problem, and another agent's rewards do not change them.
  Why sigma_k is the std of the *centred* rewards (their mean is 0 by construction, so it is their root
  mean square), not of the raw rewards: the raw std also counts how much the baselines differ between
  turns and states (e.g. the team term going from 0 at turn 0 to alpha at turn 1), the very variation
  the numerator removed; dividing by it would shrink agent k's advantages whenever its turns differ in
  team reward, a spread that says nothing about how much agent k's choices matter. The centred std
  measures the spread of exactly what the advantages carry.
  Why per problem, not over the policy's batch: it is Dr. MAS's statistic (over the actions agent k
  produced in the problem's episodes), problems of different difficulty keep separate scales as in
  GRPO, and a problem's advantages do not depend on which other problems share the policy's batch.
  With one turn per agent (a group per agent per problem) it equals std_scope="group".
- grouping="agent" (Dr. MAS as published, for parallel sampling): all of agent k's samples of the problem
  form one group: A_i = (r_i - mu_k) / (sigma_k + eps) with agent k's own mean and std of rewards. Under
  tree sampling a problem has one episode, so this group pools K x T candidates from different states and
  turns and its mean mixes their baselines: use agent_turn with std_scope="agent" there (the config
  refuses grouping=agent with tree sampling).
- grouping="trajectory" (vanilla GRPO, for parallel sampling): the episodes of one problem form a group over
  their returns; every sample of an episode gets that episode's advantage.

normalize_std=False drops the division: A_i = r_i - mean, whatever the std scope.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable

import numpy as np

from mas_async.wire.samples import Sample

GROUPINGS = ("agent_turn", "agent", "trajectory")
STD_SCOPES = ("group", "agent")


def compute_advantages(
    samples: list[Sample],
    grouping: str = "agent_turn",
    eps: float = 1e-6,
    normalize_std: bool = True,
    std_scope: str = "group",
) -> np.ndarray:
    """One advantage per sample (float32[len(samples)]), in the order of `samples` (maths: module docstring).

    std_scope: "group" divides by the std of the sample's own group; "agent" (only with grouping
    "agent_turn") divides by sigma_k, the std of agent k's centred rewards over the problem.
    """
    if grouping not in GROUPINGS:
        raise ValueError(f"unknown advantage grouping {grouping!r}: expected one of {', '.join(GROUPINGS)}")
    if std_scope not in STD_SCOPES:
        raise ValueError(f"unknown advantage std_scope {std_scope!r}: expected one of {', '.join(STD_SCOPES)}")
    if std_scope == "agent" and grouping != "agent_turn":
        raise ValueError(
            f"std_scope 'agent' scales agent_turn groups by the agent's own std; grouping {grouping!r} "
            "has no per-turn groups (grouping 'agent' already uses the agent's std)"
        )
    advantages = np.zeros(len(samples), dtype=np.float64)
    if grouping == "trajectory":
        _trajectory(samples, advantages, eps, normalize_std)
        return advantages.astype(np.float32)
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        key = (sample.problem_id, sample.group) if grouping == "agent_turn" else (sample.problem_id, sample.agent)
        groups[key].append(i)
    if std_scope == "agent" and normalize_std:
        _agent_scaled(samples, groups, advantages, eps)
        return advantages.astype(np.float32)
    for indices in groups.values():
        rewards = np.array([samples[i].reward for i in indices], dtype=np.float64)
        advantages[indices] = _normalise(rewards, eps, normalize_std)
    return advantages.astype(np.float32)


def _agent_scaled(samples: list[Sample], groups: dict[Hashable, list[int]], out: np.ndarray, eps: float) -> None:
    # Centre within each (episode, agent, turn) group, then divide by the root mean square of the centred
    # rewards of the group's agent over the problem. A group of one has no baseline: it stays 0 and does
    # not count towards sigma_k (it would only dilute it with a residual that is 0 by definition).
    residuals: dict[tuple[str, str], list[float]] = defaultdict(list)
    for indices in groups.values():
        if len(indices) < 2:
            continue
        rewards = np.array([samples[i].reward for i in indices], dtype=np.float64)
        out[indices] = rewards - rewards.mean()
        first = samples[indices[0]]
        residuals[(first.problem_id, first.agent)] += out[indices].tolist()
    sigma = {key: float(np.sqrt(np.mean(np.square(values)))) for key, values in residuals.items()}
    for i, sample in enumerate(samples):
        scale = sigma.get((sample.problem_id, sample.agent))
        if scale is not None:
            out[i] /= scale + eps


def _trajectory(samples: list[Sample], out: np.ndarray, eps: float, normalize_std: bool) -> None:
    # problem -> episode -> indices of its samples; each episode counts once, whatever its length.
    episodes: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, sample in enumerate(samples):
        episodes[sample.problem_id][sample.episode_id].append(i)
    for by_episode in episodes.values():
        returns = []
        for episode_id, indices in by_episode.items():
            values = {samples[i].episode_return for i in indices}
            if len(values) != 1:
                raise ValueError(f"episode {episode_id!r} has samples with different returns {sorted(values)}")
            returns.append(values.pop())
        normalised = _normalise(np.array(returns, dtype=np.float64), eps, normalize_std)
        for advantage, indices in zip(normalised, by_episode.values(), strict=True):
            out[indices] = advantage


def _normalise(rewards: np.ndarray, eps: float, normalize_std: bool) -> np.ndarray:
    if rewards.size < 2:
        return np.zeros_like(rewards)
    centred = rewards - rewards.mean()
    return centred / (rewards.std() + eps) if normalize_std else centred
