"""Group-relative advantages for GRPO-style training, with the three groupings of the ablations.

- "agent_turn" (AT-GRPO, the default): the K candidates of one agent at one turn of one episode form a
  group (`Sample.group`); each candidate's advantage is its reward relative to its group.
- "agent" (Dr. MAS): all of one agent's samples of the same problem form a group, so each agent's
  rewards are normalised with that agent's own mean and std.
- "trajectory" (vanilla GRPO): the episodes of one problem form a group over their returns; every
  sample of an episode gets that episode's advantage.

A = (r - mean) / (std + eps) with the population std (ddof=0), or A = r - mean without std
normalisation; a group of one gets 0. Groups are always also keyed by problem, so two problems never
share a mean even if their episode ids were to collide.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable

import numpy as np

from mas_async.wire.samples import Sample

GROUPINGS = ("agent_turn", "agent", "trajectory")


def compute_advantages(
    samples: list[Sample], grouping: str = "agent_turn", eps: float = 1e-6, normalize_std: bool = True
) -> np.ndarray:
    """One advantage per sample (float32[len(samples)]), in the order of `samples`."""
    if grouping not in GROUPINGS:
        raise ValueError(f"unknown advantage grouping {grouping!r}: expected one of {', '.join(GROUPINGS)}")
    advantages = np.zeros(len(samples), dtype=np.float64)
    if grouping == "trajectory":
        _trajectory(samples, advantages, eps, normalize_std)
        return advantages.astype(np.float32)
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        key = (sample.problem_id, sample.group) if grouping == "agent_turn" else (sample.problem_id, sample.agent)
        groups[key].append(i)
    for indices in groups.values():
        rewards = np.array([samples[i].reward for i in indices], dtype=np.float64)
        advantages[indices] = _normalise(rewards, eps, normalize_std)
    return advantages.astype(np.float32)


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
