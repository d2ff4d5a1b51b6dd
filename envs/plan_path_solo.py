"""Plan-Path for a single agent: the baseline the two-agent team is compared against.

The same grids, problems and rules as `envs.plan_path`, but one agent, "solo", moves the token in any
of the four directions ("U", "D", "L", "R"), one move per step: the whole task with one policy and no
split of roles. `infos["solo"]["blocked"]` is True when the move hit a wall or the grid's edge.
"""

from __future__ import annotations

import math
import random
from typing import Any

from envs.plan_path import MOVES, PlanPathEnv, landing
from envs.reference_policies import solo_always, solo_moves, solo_random, ties
from mas_async.api import ReferencePolicy

AXIS = {"U": "vertical", "D": "vertical", "L": "horizontal", "R": "horizontal"}
DELTAS = {letter: MOVES[agent][letter] for letter, agent in AXIS.items()}  # "U" -> (-1, 0), ...


class PlanPathSoloEnv(PlanPathEnv):
    """One agent, both axes: see the module docstring."""

    actions = {"solo": 'a move, "U", "D", "L" or "R": the token goes one cell that way (blocked: it stays)'}
    info_keys = {"solo": {"blocked": "the move hit a wall or the edge", "moves": "a macro action: the moves applied"}}

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
        """random, always_<M>, toward_goal (a move that closes a gap, not blocked if one is free) and optimal
        (down the BFS distance)."""
        return dict(REFERENCE_POLICIES)

    @staticmethod
    def _check(agent: str) -> None:
        if agent != "solo":
            raise ValueError(f"plan_path_solo: unknown agent {agent!r}: the only agent is 'solo'")


# -- reference policies (`PlanPathSoloEnv.reference_policies`) ------------------------------------


def _toward_goal(env: Any, agent: str, rng: random.Random) -> str:
    gaps = (env.goal[0] - env.position[0], env.goal[1] - env.position[1])
    closing = [m for m in solo_moves(AXIS, agent) if any(d * g > 0 for d, g in zip(DELTAS[m], gaps, strict=True))]
    free = [m for m in closing if landing(env, DELTAS[m]) != env.position]
    return rng.choice(free or closing)


def _optimal(env: Any, agent: str, rng: random.Random) -> str:
    return ties(solo_moves(AXIS, agent), lambda m: env.dist.get(landing(env, DELTAS[m]), math.inf), rng)


REFERENCE_POLICIES: dict[str, ReferencePolicy] = {
    "random": solo_random(AXIS),
    **{f"always_{m}": solo_always(m) for m in AXIS},
    "toward_goal": _toward_goal,
    "optimal": _optimal,
}
