"""Sokoban for a single agent: the baseline the two-pusher team (`envs.sokoban`) is compared against.

The same levels and rules as `envs.sokoban`, but one agent, "solo", moves the keeper in any of the four
directions ("U", "D", "L", "R"), one move per step: the whole task with one policy and no alternation.
`distance()` is the fewest such free moves that solve the level from here (a breadth-first search over
the level's states, like the team's `team_distances` but without whose-move phases, so never more than
the team's distance); a move after which no solution is left (a box in a corner, ...) terminates the
episode with `infos["solo"]["deadlock"]` True. `infos["solo"]["blocked"]` is True when the move hit a
wall or a box that cannot move. Every generated level is solvable by the team, hence by the solo agent.
"""

from __future__ import annotations

import math
import random
from collections import deque
from functools import lru_cache
from typing import Any

from envs.reference_policies import solo_always, solo_moves, solo_random, ties
from envs.sokoban import MOVES, Board, SokobanEnv, State, move
from mas_async.api import ReferencePolicy

AXIS = {letter: agent for agent, moves in MOVES.items() for letter in moves}  # "U" -> "vertical", ...
DELTAS = tuple(delta for moves in MOVES.values() for delta in moves.values())
DELTA = {letter: delta for moves in MOVES.values() for letter, delta in moves.items()}  # "U" -> (-1, 0), ...


@lru_cache(maxsize=64)
def solo_distances(board: Board, start: State) -> dict[State, int]:
    """Fewest free moves to solve from every state reachable from `start`; states that cannot be solved
    are absent. Shared by every env and clone of the same problem: callers must not mutate it."""
    parents: dict[State, list[State]] = {start: []}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        for delta in DELTAS:
            nxt, blocked = move(board, state, delta)
            if blocked:
                continue  # a free mover never needs to bump into a wall
            if nxt not in parents:
                parents[nxt] = []
                queue.append(nxt)
            parents[nxt].append(state)
    dist = {state: 0 for state in parents if board.solved(state)}
    queue = deque(dist)
    while queue:
        state = queue.popleft()
        for parent in parents[state]:
            if parent not in dist:
                dist[parent] = dist[state] + 1
                queue.append(parent)
    return dist


class SokobanSoloEnv(SokobanEnv):
    """One agent, all four directions: see the module docstring."""

    actions = {"solo": 'a move, "U", "D", "L" or "R": the keeper walks (or pushes a box) one cell that way'}
    info_keys = {
        "solo": {
            "blocked": "the move hit a wall or a box that cannot move",
            "deadlock": "the move left the level unsolvable (the episode ends)",
            "moves": "a macro action: the moves applied",
        }
    }

    possible_agents = ["solo"]

    def observe(self, agent: str) -> str:
        self._check(agent)
        return "S" + super().observe("vertical")[1:]  # role letter S, then the same room and coordinates

    def step(self, agent: str, action: str) -> None:
        self._check(agent)
        if action not in AXIS:
            raise ValueError(f"sokoban_solo: action must be one of U, D, L, R, got {action!r}")
        super().step(AXIS[action], action)  # the parent's deadlock check calls `distance`, ours
        self.infos = {"solo": self.infos.pop(AXIS[action])}

    def distance(self, agent: str = "solo") -> int | None:
        """Fewest free moves that solve the level from here; None if it cannot be solved. The solo agent
        always moves next, so `agent` (which the parent's `step` passes as a mover's name) changes nothing."""
        return solo_distances(self.board, self.start).get(self.state)

    def action_examples(self, agent: str) -> list[str]:
        self._check(agent)
        return [] if self.done else list(AXIS)

    def move_quality(self, agent: str, action: Any, after: SokobanEnv) -> bool | None:
        """A good move leaves fewer moves to the solution (`eval/progress_rate/solo`)."""
        before, left = self.distance(), after.distance()
        return before is not None and left is not None and left < before

    @classmethod
    def reference_policies(cls) -> dict[str, Any]:
        """random, always_<M> and optimal (down the breadth-first solver's distance, `solo_distances`)."""
        return dict(REFERENCE_POLICIES)

    @staticmethod
    def _check(agent: str) -> None:
        if agent != "solo":
            raise ValueError(f"sokoban_solo: unknown agent {agent!r}: the only agent is 'solo'")


# -- reference policies (`SokobanSoloEnv.reference_policies`) -------------------------------------


def _optimal(env: Any, agent: str, rng: random.Random) -> str:
    left = solo_distances(env.board, env.start)
    return ties(solo_moves(AXIS, agent), lambda m: left.get(move(env.board, env.state, DELTA[m])[0], math.inf), rng)


REFERENCE_POLICIES: dict[str, ReferencePolicy] = {
    "random": solo_random(AXIS),
    **{f"always_{m}": solo_always(m) for m in AXIS},
    "optimal": _optimal,
}
