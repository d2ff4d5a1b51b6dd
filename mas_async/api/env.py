"""The `Env` base class: what an environment must provide to be trained on (part of the framework API).

Envs speak the PettingZoo (AEC) vocabulary: `possible_agents`, `reset(seed, options)`, `observe(agent)`,
`step(agent, action)`, and the per-agent dicts `terminations`, `truncations` and `infos`. Unlike
PettingZoo, the workflow (not the env) decides who acts next, so `step` names the acting agent.

Three additions serve training:

- `team_reward()` is the shared reward of the team in the current state (AT-GRPO scores a candidate
  action with `alpha * team_reward() + node.local_reward(...)`), and `success()` says whether the
  episode solved its problem.
- `clone()` returns a deep, independent copy: tree sampling scores each of the K candidate actions on
  its own clone and continues the episode from the best one.
- `problems(split, count, **options)` builds a dataset: a list of plain dicts, one per problem, that
  `reset(options={"problem": problem})` accepts. Procedural envs generate them from seeds; the seeds of
  the "train" and "test" splits never overlap.
"""

from __future__ import annotations

import copy
from typing import Any

SPLITS = ("train", "test")


class Env:
    """Base class of every environment (a subclass is named in the config by a registry key or path).

    A subclass sets `possible_agents` and implements `reset`, `observe`, `step`, `team_reward` and
    `problems`; `clone` (deep copy), `success` (`team_reward() >= 1.0`) and `close` have defaults.
    A complete toy env, one agent that must say the secret word:

        class Echo(Env):
            possible_agents = ["speaker"]

            def reset(self, seed=None, options=None):
                self.word = (options or {})["problem"]["word"]
                self.said = ""
                self.terminations = {"speaker": False}
                self.truncations = {"speaker": False}
                self.infos = {"speaker": {}}

            def observe(self, agent):
                return f"SAY {self.word}"

            def step(self, agent, action):
                self.said = action
                self.terminations[agent] = True

            def team_reward(self):
                return 1.0 if self.said == self.word else 0.0

            @classmethod
            def problems(cls, split, count, **options):
                check_split(split, count)
                first = 0 if split == "train" else 10**9
                return [{"seed": first + i, "word": f"W{first + i}"} for i in range(count)]

        env = Echo()
        env.reset(options={"problem": Echo.problems("train", 1)[0]})
        env.step("speaker", "W0")
        assert env.success()
    """

    possible_agents: list[str] = []
    runs_code: bool = False
    """True for an env that runs model-written programs (`run_python`, `run_tests`): its env workers
    refuse to start where the sandbox cannot isolate them (`require_isolation`), unless the config says
    `sandbox.unsafe_no_isolation: true`."""
    terminations: dict[str, bool]
    truncations: dict[str, bool]
    infos: dict[str, dict[str, Any]]

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """Start an episode; `options={"problem": dict}` selects the problem (one of `problems()`)."""
        raise NotImplementedError

    def observe(self, agent: str) -> Any:
        """What `agent` sees now (for LLM agents, usually a string that the node puts in its prompt)."""
        raise NotImplementedError

    def step(self, agent: str, action: Any) -> None:
        """Apply `agent`'s action (already parsed by its node) to the current state."""
        raise NotImplementedError

    def team_reward(self) -> float:
        """The team's shared reward in the current state."""
        raise NotImplementedError

    def success(self) -> bool:
        """Whether the current state solves the problem."""
        return self.team_reward() >= 1.0

    @property
    def done(self) -> bool:
        """True once any agent is terminated or truncated (the episode is over)."""
        return any(self.terminations.values()) or any(self.truncations.values())

    def clone(self) -> Env:
        """A deep, independent copy: stepping the copy never changes this env. Override to be cheaper
        (most envs return `self.shallow_clone()` after copying whatever state their step mutates)."""
        return copy.deepcopy(self)

    def shallow_clone(self) -> Env:
        """A copy of the same type sharing every attribute with this env except the per-agent dicts
        (terminations, truncations, infos), which are copied: the base of a cheap `clone` for an env
        whose other attributes are immutable or replaced (never mutated in place) by `step`."""
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.terminations = dict(self.terminations)
        other.truncations = dict(self.truncations)
        other.infos = {agent: dict(info) for agent, info in self.infos.items()}
        return other

    def close(self) -> None:
        """Release resources (subprocesses, files); the default has none."""

    @classmethod
    def problems(cls, split: str, count: int, **options: Any) -> list[dict[str, Any]]:
        """`count` problems of `split` ("train" or "test") as plain dicts; train and test never overlap."""
        raise NotImplementedError


def check_split(split: str, count: int) -> None:
    """Raise a ValueError naming the mistake if `split` or `count` is not a valid dataset request."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: expected one of {', '.join(SPLITS)}")
    if not isinstance(count, int) or count < 0:
        raise ValueError(f"problem count must be a non-negative integer, got {count!r}")


async def step_env(env: Env, agent: str, action: Any) -> None:
    """Apply `action`: `await env.astep(agent, action)` when the env has one (an env that runs code in
    the sandbox, without blocking the event loop), else the synchronous `env.step(agent, action)`."""
    astep = getattr(env, "astep", None)
    if astep is not None:
        await astep(agent, action)
    else:
        env.step(agent, action)
