"""Plan-Path for a single agent: the baseline the two-agent team is compared against.

The same grids, problems and rules as `envs.plan_path`, but one agent, "solo", moves the token in any
of the four directions ("U", "D", "L", "R"), one move per step: the whole task with one policy and no
split of roles. `infos["solo"]["blocked"]` is True when the move hit a wall or the grid's edge.
"""

from __future__ import annotations

from typing import Any

from envs.plan_path import PlanPathEnv

AXIS = {"U": "vertical", "D": "vertical", "L": "horizontal", "R": "horizontal"}


class PlanPathSoloEnv(PlanPathEnv):
    """One agent, both axes: see the module docstring."""

    possible_agents = ["solo"]

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        super().reset(seed=seed, options=options)
        self.infos = {"solo": {"blocked": False}}

    def observe(self, agent: str) -> str:
        self._check(agent)
        return "S" + super().observe("vertical")[1:]  # role letter S, then the same grid and coordinates

    def step(self, agent: str, action: str) -> None:
        self._check(agent)
        if action not in AXIS:
            raise ValueError(f"plan_path_solo: action must be one of U, D, L, R, got {action!r}")
        super().step(AXIS[action], action)
        self.infos = {"solo": self.infos.pop(AXIS[action])}

    def action_examples(self, agent: str) -> list[str]:
        self._check(agent)
        return [] if self.done else list(AXIS)

    @classmethod
    def reference_policies(cls) -> dict[str, Any]:
        """random, always_<M>, toward_goal and optimal (down the BFS distance): see
        envs/reference_policies.py."""
        from envs.reference_policies import PLAN_PATH_SOLO  # (that module reads this one's rules)

        return dict(PLAN_PATH_SOLO)

    @staticmethod
    def _check(agent: str) -> None:
        if agent != "solo":
            raise ValueError(f"plan_path_solo: unknown agent {agent!r}: the only agent is 'solo'")
