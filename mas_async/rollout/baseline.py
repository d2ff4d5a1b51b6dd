"""The baseline episode: one of the env's reference policies plays through the run's own workflow.

`Env.reference_policies()` names fixed policies (uniform random moves, a constant answer, the env's own
heuristic or solver). To know what a trained policy's held-out figures are worth, the run plays each
of them once, on the same held-out problems as `eval`, through the same workflow, the same nodes'
local rewards and the same team reward: a `BaselineEpisode` is an `Episode` whose `sample` asks the
reference policy for each candidate's action instead of generating a reply, then scores it on its own
clone exactly as a parsed candidate is scored (`Episode._score_action`). Nothing is generated, so no
request leaves the env worker, and nothing is recorded for training (its mode is "baseline/<name>",
never "train"). The router dispatches these episodes beside the run's first evaluation and reports
them as `eval/baseline/<name>/...` (router/report.py).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from mas_async.rollout.episode import BASELINE_PREFIX, Episode

if TYPE_CHECKING:
    from mas_async.api.env import Env, ReferencePolicy
    from mas_async.api.node import Node
    from mas_async.api.workflow import Candidate

NO_PROMPT = np.zeros(0, dtype=np.int32)


class UnknownBaseline(ValueError):
    """A baseline episode names a reference policy that its env does not have."""


def baseline_mode(name: str) -> str:
    """The episode mode of reference policy `name`: "baseline/<name>"."""
    return BASELINE_PREFIX + name


def baseline_name(mode: str) -> str | None:
    """The reference policy of a "baseline/<name>" mode; None for any other mode."""
    return mode[len(BASELINE_PREFIX) :] if mode.startswith(BASELINE_PREFIX) else None


def check_baseline_names(env_name: str, names: list[str]) -> list[str]:
    """`names` (an env's reference policies) if each can name a mode and a metric, else a ValueError."""
    bad = [n for n in names if not isinstance(n, str) or not n or "/" in n or any(ch.isspace() for ch in n)]
    if bad:
        raise ValueError(
            f"env {env_name!r}: reference policy names must be non-empty strings without '/' or spaces, got {bad[0]!r}"
        )
    return names


class BaselineEpisode(Episode):
    """An episode in which the env's reference policy `name` chooses every action (see the module docstring).

    `rng` is the policy's only source of randomness: seeded per episode, a rerun plays the same moves."""

    def __init__(
        self,
        *,
        name: str,
        policies: Mapping[str, ReferencePolicy],
        rng: random.Random,
        episode_id: str,
        problem_id: str,
        env: Env,
        policy_of: dict[str, str],
        alpha: float,
        seed: int = 0,
    ) -> None:
        if name not in policies:
            known = ", ".join(sorted(policies)) or "(none)"
            raise UnknownBaseline(f"{type(env).__name__} has no reference policy {name!r}: it has {known}")
        super().__init__(
            episode_id=episode_id,
            problem_id=problem_id,
            env=env,
            policy_of=policy_of,
            tokenizers=dict.fromkeys(policy_of.values()),
            generate=_no_generate,
            k=1,
            alpha=alpha,
            mode=baseline_mode(name),
            seed=seed,
            greedy=True,
        )
        self.name = name
        self.reference = policies[name]
        self.rng = rng

    async def sample(self, node: Node, n: int | None = None, greedy: bool | None = None) -> list[Candidate]:
        """`n` (default 1) candidates of `node`, each an action of the reference policy in the committed
        state, scored on its own clone as a parsed candidate is."""
        policy = self._policy(node.agent)
        n = self.k if n is None else n
        self._turns_played.add(self.turn)
        candidates = []
        for index in range(n):
            action = self.reference(self.env, node.agent, self.rng)
            text = f"[{self.name}] {action!r}"
            candidates.append(await self._score_action(node, policy, index, NO_PROMPT, None, text, action))
        return candidates

    def finish(self) -> dict[str, Any]:
        """The episode's metrics, without a parse-failure rate: no reply was parsed."""
        self.invalid.clear()
        return super().finish()


async def _no_generate(policy: str, prompt_ids: Any, n: int, greedy: bool) -> list:
    raise AssertionError("a baseline episode never generates")  # internal invariant: sample() is overridden
