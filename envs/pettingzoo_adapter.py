"""Any mas-async env as a PettingZoo `AECEnv`, so the ecosystem's tools (and its `api_test`) can use it.

Our envs let the workflow name the acting agent; PettingZoo's AEC envs choose it themselves. The
adapter takes turns round-robin over `order` (a workflow's `agents`, or the env's `possible_agents`),
and speaks text: every agent's observation and action space is a `gymnasium.spaces.Text` over the env's
observation charset (`envs.check.observation_charset`).

    from envs.pettingzoo_adapter import aec_env, from_config
    env = aec_env("sokoban", workflow="sokoban")      # registry keys or "module:Class" paths
    env = from_config("configs/sokoban_tiny.yaml")    # or a run's env, turn order, nodes and alpha
    env.reset(seed=0)
    for agent in env.agent_iter():
        obs, reward, terminated, truncated, info = env.last()
        env.step(None if terminated or truncated else "U" if agent == "vertical" else "L")

A step hands the action text to the agent's node (`nodes`, optional: its `parse`) and then to a clone of
the env, which replaces the env once it has stepped; an action that fails to parse or that the env
refuses (ValueError, or TypeError from an env whose actions are not strings, such as the code env's,
when no node parses the text) leaves the env as it was and is recorded in `infos[agent]["error"]`. Rewards
follow AT-GRPO's scoring: every agent gets the change of `alpha * team_reward()`, and the acting agent
also its node's `local_reward` (none without nodes), or its node's `invalid_penalty` (-1.0 without
nodes) for an invalid action. Terminations and truncations are the env's; after `max_cycles` rounds
every agent is truncated.

Reset picks the problem from `options["problem"]`, else problem `seed % len(problems)` of a small list
(`problems`, or `env_cls.problems(split, count, **env_options)`), else the next one of that list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium.spaces import Text
from pettingzoo import AECEnv

from envs.check import MAX_OBSERVATION_CHARS, observation_charset

if TYPE_CHECKING:
    from mas_async.api import Env, Node

DEFAULT_PENALTY = -1.0


class TextObservation(str):
    """An observation string. PettingZoo's `api_test` compares every observation's `dtype` with its
    space's; a `Text` space's dtype is numpy's str dtype, which a plain `str` does not carry."""

    dtype = np.dtype(str)


class PettingZooEnv(AECEnv):
    """`env_cls` as an AEC env: see the module docstring for turns, rewards and problems."""

    def __init__(
        self,
        env_cls: type[Env],
        *,
        order: Sequence[str] | None = None,
        nodes: dict[str, Node] | None = None,
        problems: list[dict[str, Any]] | None = None,
        env_options: dict[str, Any] | None = None,
        split: str = "train",
        count: int = 4,
        alpha: float = 1.0,
        max_cycles: int = 8,
        max_action_chars: int = 16,
    ) -> None:
        super().__init__()
        self.env_cls = env_cls
        self.possible_agents = list(env_cls().possible_agents)
        self.order = list(order) if order else list(self.possible_agents)
        unknown = sorted(set(self.order) - set(self.possible_agents))
        if unknown or len(set(self.order)) != len(self.order):
            raise ValueError(
                f"{env_cls.__name__}: order {self.order} must name distinct agents of {self.possible_agents}"
            )
        self.nodes = dict(nodes or {})
        self._problems = problems
        self._problem_args = (split, count, dict(env_options or {}))
        self._next_problem = 0
        self.alpha = float(alpha)
        self.max_cycles = max_cycles
        self.metadata = {"name": f"mas_async_{env_cls.__name__}", "render_modes": [], "is_parallelizable": False}
        charset = observation_charset(env_cls)
        self.observation_spaces = {
            a: Text(MAX_OBSERVATION_CHARS, min_length=0, charset=charset) for a in self.possible_agents
        }
        self.action_spaces = {a: Text(max_action_chars, min_length=1, charset=charset) for a in self.possible_agents}
        self.env: Env | None = None

    def observation_space(self, agent: str) -> Text:
        return self.observation_spaces[agent]

    def action_space(self, agent: str) -> Text:
        return self.action_spaces[agent]

    def problems(self) -> list[dict[str, Any]]:
        """The problems reset draws from (generated on first use)."""
        if self._problems is None:
            split, count, options = self._problem_args
            self._problems = self.env_cls.problems(split, count, **options)
            if not self._problems:
                raise ValueError(f"{self.env_cls.__name__}.problems({split!r}, {count}) returned no problem")
        return self._problems

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        problem = (options or {}).get("problem")
        if problem is None:
            problems = self.problems()
            index = seed if seed is not None else self._next_problem
            self._next_problem = index + 1
            problem = problems[index % len(problems)]
        self.env = self.env_cls()
        self.env.reset(seed=seed, options={"problem": problem})
        self.agents = list(self.possible_agents)
        self.rewards = {a: 0.0 for a in self.agents}
        self._cumulative_rewards = {a: 0.0 for a in self.agents}
        self.infos = {a: dict(self.env.infos.get(a, {})) for a in self.agents}
        self.terminations = {a: bool(self.env.terminations.get(a, False)) for a in self.agents}
        self.truncations = {a: bool(self.env.truncations.get(a, False)) for a in self.agents}
        self._steps = 0
        self.agent_selection = self.order[0]

    def observe(self, agent: str) -> TextObservation:
        return TextObservation(self._env().observe(agent))

    def step(self, action: Any) -> None:
        agent = self.agent_selection
        if self.terminations[agent] or self.truncations[agent]:
            self._was_dead_step(action)
            return
        env = self._env()
        self._cumulative_rewards[agent] = 0.0
        node = self.nodes.get(agent)
        team_before, local, error = env.team_reward(), 0.0, None
        try:
            parsed = node.parse(str(action)) if node is not None else action
            after = env.clone()
            after.step(agent, parsed)
        except (ValueError, TypeError) as e:  # ParseError is a ValueError; envs refuse invalid actions so
            after, error = env, f"{type(e).__name__}: {e}"
            local = node.invalid_penalty if node is not None else DEFAULT_PENALTY
        else:
            local = float(node.local_reward(env, parsed, after)) if node is not None else 0.0
        self.env = after
        self._steps += 1
        shared = self.alpha * (after.team_reward() - team_before)
        self.rewards = {a: shared + (local if a == agent else 0.0) for a in self.agents}
        out_of_time = self._steps >= self.max_cycles * len(self.order)
        for a in self.agents:
            self.terminations[a] = bool(after.terminations.get(a, False))
            self.truncations[a] = bool(after.truncations.get(a, False)) or (out_of_time and not self.terminations[a])
            self.infos[a] = dict(after.infos.get(a, {}))
        self.infos[agent]["error"] = error
        self.agent_selection = self._next_agent(agent)
        self._accumulate_rewards()
        self._deads_step_first()

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None

    def _env(self) -> Env:
        if self.env is None:
            raise RuntimeError(f"{self.metadata['name']}: call reset() before observe() or step()")
        return self.env

    def _next_agent(self, agent: str) -> str:
        start = self.order.index(agent)
        for offset in range(1, len(self.order) + 1):
            candidate = self.order[(start + offset) % len(self.order)]
            if candidate in self.agents:
                return candidate
        return agent


def aec_env(
    env: str, workflow: str | None = None, *, with_nodes: dict[str, str] | None = None, **kwargs: Any
) -> PettingZooEnv:
    """`PettingZooEnv` for an env named as in a config (a registry key or "module:Class"); with a
    `workflow`, agents take turns in its `agents` order; `with_nodes` maps agents to node names."""
    from envs import ENVS
    from mas_async.api import resolve
    from nodes import NODES, WORKFLOWS

    env_cls = resolve(env, ENVS, "env")
    if workflow is not None:
        kwargs.setdefault("order", resolve(workflow, WORKFLOWS, "workflow").agents or None)
    if with_nodes:
        kwargs["nodes"] = {agent: resolve(name, NODES, "node")(agent) for agent, name in with_nodes.items()}
    return PettingZooEnv(env_cls, **kwargs)


def from_config(path: str, overrides: list[str] | None = None, **kwargs: Any) -> PettingZooEnv:
    """`PettingZooEnv` for the team of a run config: its env (and problem options), its workflow's turn
    order, its agents' nodes (which parse the action text), its alpha, and max_turns as max_cycles."""
    from mas_async.api import load_config

    config = load_config(path, overrides)
    options = config.workflow.options
    if isinstance(options.get("max_turns"), int):
        kwargs.setdefault("max_cycles", options["max_turns"])
    kwargs.setdefault("alpha", config.algorithm.alpha)
    kwargs.setdefault("env_options", config.env.options)
    nodes = {agent: spec.node for agent, spec in config.agents.items()}
    return aec_env(config.env.name, config.workflow.name, with_nodes=nodes, **kwargs)
