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
  the "train" and "test" splits never overlap, and a run holds out only test problems whose content (`problem_content`: the dict, seed aside) no training problem has.

Two optional additions put a trained policy's figures in context:

- `reference_policies()` names fixed policies (uniform random, constant answers, the env's own
  heuristic or solver) that the run plays through its workflow on the held-out problems, beside the
  first evaluation (`eval/baseline/<name>/...`, each figure the policy's expectation: exact where its
  choices can be enumerated, else drawn): a policy must beat them to have learned anything.
- `move_quality(agent, action, after)` judges one move (e.g. "it shortened the distance to the
  goal"); an episode's share of good committed moves is logged as `progress_rate/<agent>`.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from typing import Any

SPLITS = ("train", "test")

ReferencePolicy = Callable[["Env", str, random.Random], Any]
"""`(env, agent, rng) -> action`: what a fixed policy plays for `agent` in `env`'s current state (the
kind of value the agent's node's `parse` returns); `rng` is its only source of randomness."""


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

            @classmethod
            def reference_policies(cls):
                return {
                    "silent": lambda env, agent, rng: "",
                    "random": lambda env, agent, rng: rng.choice(["W0", "W1", env.word]),
                    "oracle": lambda env, agent, rng: env.word,
                }

            def move_quality(self, agent, action, after):
                return after.said == self.word

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
    actions: dict[str, str] = {}
    """agent -> what its action is: the Python value its node's `parse` returns, and what it does. Shown by
    `mas-async envs` and docs/reference/envs-and-models.md (an agent that plays after another has no
    example action at the start: this is what a user reads); `check_env` checks every agent has one."""
    rewards: str = ""
    """What `team_reward()` is and when an episode ends (each agent's local reward is its node's)."""
    info_keys: dict[str, dict[str, str]] = {}
    """agent -> each key its `infos[agent]` can hold, and what it means; `check_env` checks that every key
    the env sets is here."""
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

    @classmethod
    def reference_policies(cls) -> dict[str, ReferencePolicy]:
        """Fixed policies to measure a trained one against, by name: each is called as
        `policy(env, agent, rng)` whenever `agent` acts, and returns the action it plays (what the agent's
        node would parse from a reply); `rng` is its only randomness, and when it draws only by `choice`,
        `randrange`, `randint`, `shuffle` or `sample` its expectation can be computed exactly. The run plays
        each one through its own workflow and nodes' rewards on the held-out problems (logged as
        `eval/baseline/<name>/...`, docs/evaluation.md). Name them after what they do:
        "random" (uniform over the legal actions), "always_<action>" (a constant answer), the env's own
        heuristic, "optimal" (the best possible, a ceiling). The default has none."""
        return {}

    def move_quality(self, agent: str, action: Any, after: Env) -> bool | None:
        """Whether `agent`'s `action` in this state (the one before it), which led to `after`, was a
        good move (e.g. it shortened the distance to the goal); `action` is None when the agent's reply
        did not parse (`after` is then this state, unchanged). None: the env does not judge this
        agent's moves (the default). The share of an episode's committed moves judged good is logged
        per agent as `progress_rate/<agent>`."""
        return None


def check_split(split: str, count: int) -> None:
    """Raise a ValueError naming the mistake if `split` or `count` is not a valid dataset request."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: expected one of {', '.join(SPLITS)}")
    if not isinstance(count, int) or count < 0:
        raise ValueError(f"problem count must be a non-negative integer, got {count!r}")


SEED_KEYS = ("seed",)
"""Keys of a problem dict that name where it came from, not what it is."""


def problem_content(problem: dict[str, Any]) -> str:
    """What a problem is, its seed aside, as one string: two problems with the same content are the same
    problem, whatever seeds drew them (procedural envs draw the same small grid from many seeds)."""
    return json.dumps({k: v for k, v in problem.items() if k not in SEED_KEYS}, sort_keys=True)


async def step_env(env: Env, agent: str, action: Any) -> None:
    """Apply `action`: `await env.astep(agent, action)` when the env has one (an env that runs code in
    the sandbox, without blocking the event loop), else the synchronous `env.step(agent, action)`."""
    astep = getattr(env, "astep", None)
    if astep is not None:
        await astep(agent, action)
    else:
        env.step(agent, action)
