"""The games' reference policies: the fixed players a trained team is measured against.

Each policy is `(env, agent, rng) -> action` (`mas_async.api.ReferencePolicy`): the action `agent` plays
in `env`'s current state, of the kind its node's `parse` returns. The run plays each one once through
its own workflow and nodes' rewards on the held-out problems (`eval/baseline/<name>/...`), so a policy
that learned nothing shows up as one of these lines. Each env names its set in `reference_policies()`:

- Plan-Path movers (`PLAN_PATH`): `random` (uniform over the mover's two moves; the shipped movers never
  play "S"), `always_<V>_<H>` (the four constant team answers: a collapsed policy), `toward_goal` (each
  mover steps toward the goal on its own axis; once aligned, a move that is not blocked, else either),
  `optimal` (the move after which the fewest alternating team moves are left, `team_moves`: a ceiling).
- Plan-Path solo (`PLAN_PATH_SOLO`): `random`, `always_<M>`, `toward_goal` (a move that closes a gap,
  not blocked if one is free), `optimal` (down the BFS distance).
- Sokoban movers (`SOKOBAN`): `random`, `always_<V>_<H>`, `optimal` (the alternating team's
  breadth-first solver, `team_distances`); solo (`SOKOBAN_SOLO`): `random`, `always_<M>`, `optimal`.
- Sudoku chooser + placer (`SUDOKU`): `random` (an open cell, any digit), `always_A_<d>` (cell A, digit
  d), `fewest_candidates` (the open cell with the fewest candidate digits, then one of its candidates:
  the forced one when there is one), `optimal` (that cell and its solution digit); solo (`SUDOKU_SOLO`):
  the same, as one "B3" action.
- The tool + plan team (`tool_plan`): each movers' policy above plays one movers' turn per team turn,
  so the two teams' baselines are the same on the same problems: the vertical mover's move, then the
  horizontal mover's on the state it left (a blocked move is left out: in the movers' game it leaves
  the token or keeper in place), which the tool prints from a program and the plan adopts (alone, the
  plan computes it). Each also has `solver`: the tool prints `answer()` (the breadth-first solution,
  Sudoku's solution grid), the plan adopts it: the team's own ceiling.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

from envs.plan_path import MOVES as PLAN_PATH_MOVES
from envs.plan_path import team_moves
from envs.sokoban import AGENTS as SOKOBAN_AGENTS
from envs.sokoban import MOVES as SOKOBAN_MOVES
from envs.sokoban import move, team_distances
from envs.sokoban_solo import solo_distances
from envs.tool_plan import FOUR_MOVES, MARKER
from mas_async.api import ReferencePolicy

Cell = tuple[int, int]
Turn = Callable[[Any, random.Random], Any]
"""`(env, rng) -> macro action`: what the tool + plan team's baseline plays in one turn."""


def _ties(moves: list[str], score: Callable[[str], float], rng: random.Random) -> str:
    """One of the moves with the lowest score, chosen by `rng`."""
    scores = {m: score(m) for m in moves}
    best = min(scores.values())
    return rng.choice([m for m in moves if scores[m] == best])


# -- Plan-Path -----------------------------------------------------------------------------------


def _mover_moves(agent: str) -> list[str]:
    """The moves of a Plan-Path or Sokoban mover (the same letters in both games; never "S")."""
    if agent not in ("vertical", "horizontal"):
        raise ValueError(f"a movers' reference policy plays vertical or horizontal, not {agent!r}")
    return [m for m in PLAN_PATH_MOVES[agent] if m != "S"]


def _landing(env: Any, delta: Cell) -> Cell:
    """Where the token ends up after a move by `delta` (where it is, when the move is blocked)."""
    cell = (env.position[0] + delta[0], env.position[1] + delta[1])
    inside = 0 <= cell[0] < env.rows and 0 <= cell[1] < env.cols
    return cell if inside and cell not in env.walls else env.position


@lru_cache(maxsize=65536)
def _team_left(rows: int, cols: int, walls: frozenset[Cell], cell: Cell, goal: Cell, phase: int) -> float:
    left = team_moves(rows, cols, walls, cell, goal, first=phase)
    return math.inf if left is None else left


def movers_random(env: Any, agent: str, rng: random.Random) -> str:
    return rng.choice(_mover_moves(agent))


def movers_constant(vertical: str, horizontal: str) -> ReferencePolicy:
    def always(env: Any, agent: str, rng: random.Random) -> str:
        _mover_moves(agent)
        return vertical if agent == "vertical" else horizontal

    return always


def plan_path_toward_goal(env: Any, agent: str, rng: random.Random) -> str:
    moves, axis = _mover_moves(agent), 0 if agent == "vertical" else 1
    gap = env.goal[axis] - env.position[axis]
    if gap:
        return next(m for m in moves if PLAN_PATH_MOVES[agent][m][axis] * gap > 0)
    free = [m for m in moves if _landing(env, PLAN_PATH_MOVES[agent][m]) != env.position]
    return rng.choice(free or moves)


def plan_path_optimal(env: Any, agent: str, rng: random.Random) -> str:
    partner = 1 if agent == "vertical" else 0
    return _ties(
        _mover_moves(agent),
        lambda m: _team_left(
            env.rows, env.cols, env.walls, _landing(env, PLAN_PATH_MOVES[agent][m]), env.goal, partner
        ),
        rng,
    )


PLAN_PATH: dict[str, ReferencePolicy] = {
    "random": movers_random,
    **{f"always_{v}_{h}": movers_constant(v, h) for v in "UD" for h in "LR"},
    "toward_goal": plan_path_toward_goal,
    "optimal": plan_path_optimal,
}


def _check_solo(agent: str) -> None:
    if agent != "solo":
        raise ValueError(f"a solo reference policy plays the agent 'solo', not {agent!r}")


def _solo(agent: str) -> list[str]:
    """The moves of a Plan-Path or Sokoban solo agent."""
    _check_solo(agent)
    return list(FOUR_MOVES)


def plan_path_solo_toward_goal(env: Any, agent: str, rng: random.Random) -> str:
    gaps = (env.goal[0] - env.position[0], env.goal[1] - env.position[1])
    closing = [m for m in _solo(agent) if any(d * g > 0 for d, g in zip(FOUR_MOVES[m], gaps, strict=True))]
    free = [m for m in closing if _landing(env, FOUR_MOVES[m]) != env.position]
    return rng.choice(free or closing)


def plan_path_solo_optimal(env: Any, agent: str, rng: random.Random) -> str:
    return _ties(_solo(agent), lambda m: env.dist.get(_landing(env, FOUR_MOVES[m]), math.inf), rng)


def _always(action: str) -> ReferencePolicy:
    """A solo agent's constant answer."""

    def always(env: Any, agent: str, rng: random.Random) -> str:
        _check_solo(agent)
        return action

    return always


def solo_random(env: Any, agent: str, rng: random.Random) -> str:
    return rng.choice(_solo(agent))


PLAN_PATH_SOLO: dict[str, ReferencePolicy] = {
    "random": solo_random,
    **{f"always_{m}": _always(m) for m in FOUR_MOVES},
    "toward_goal": plan_path_solo_toward_goal,
    "optimal": plan_path_solo_optimal,
}


# -- Sokoban -------------------------------------------------------------------------------------


def sokoban_optimal(env: Any, agent: str, rng: random.Random) -> str:
    left = team_distances(env.board, env.start)
    partner = 1 - SOKOBAN_AGENTS.index(agent)

    def after(m: str) -> float:
        state, _ = move(env.board, env.state, SOKOBAN_MOVES[agent][m])
        return left.get((state, partner), math.inf)

    return _ties(_mover_moves(agent), after, rng)


SOKOBAN: dict[str, ReferencePolicy] = {
    "random": movers_random,
    **{f"always_{v}_{h}": movers_constant(v, h) for v in "UD" for h in "LR"},
    "optimal": sokoban_optimal,
}


def sokoban_solo_optimal(env: Any, agent: str, rng: random.Random) -> str:
    left = solo_distances(env.board, env.start)
    return _ties(_solo(agent), lambda m: left.get(move(env.board, env.state, FOUR_MOVES[m])[0], math.inf), rng)


SOKOBAN_SOLO: dict[str, ReferencePolicy] = {
    "random": solo_random,
    **{f"always_{m}": _always(m) for m in FOUR_MOVES},
    "optimal": sokoban_solo_optimal,
}


# -- Sudoku --------------------------------------------------------------------------------------


def _open_cells(env: Any) -> list[str]:
    """Letters of the cells still empty, in reading order."""
    return [label for label, (r, c) in env.cells.items() if not env.grid[r][c]]


def _fewest(env: Any) -> str:
    """The open cell with the fewest candidate digits (the first in reading order on a tie)."""
    return min(_open_cells(env), key=lambda label: len(env.candidates(env.cells[label])))


def _sudoku_role(agent: str) -> str:
    if agent not in ("chooser", "placer"):
        raise ValueError(f"sudoku: a team's reference policy plays chooser or placer, not {agent!r}")
    return agent


def sudoku_random(env: Any, agent: str, rng: random.Random) -> str:
    if _sudoku_role(agent) == "chooser":
        return rng.choice(_open_cells(env))
    return str(rng.randint(1, env.size))


def sudoku_constant(label: str, digit: int) -> ReferencePolicy:
    def always(env: Any, agent: str, rng: random.Random) -> str:
        return label if _sudoku_role(agent) == "chooser" else str(digit)

    return always


def _candidate(env: Any, cell: Cell, rng: random.Random) -> str:
    # At random among the candidates: a fixed choice would repeat a wrong digit forever (it is never written).
    return str(rng.choice(env.candidates(cell) or list(range(1, env.size + 1))))


def sudoku_fewest_candidates(env: Any, agent: str, rng: random.Random) -> str:
    if _sudoku_role(agent) == "chooser":
        return _fewest(env)
    return _candidate(env, env.selected, rng)


def sudoku_optimal(env: Any, agent: str, rng: random.Random) -> str:
    if _sudoku_role(agent) == "chooser":
        return _fewest(env)
    r, c = env.selected
    return str(env.solution[r][c])


SUDOKU: dict[str, ReferencePolicy] = {
    "random": sudoku_random,
    **{f"always_A_{d}": sudoku_constant("A", d) for d in range(1, 5)},
    "fewest_candidates": sudoku_fewest_candidates,
    "optimal": sudoku_optimal,
}


def sudoku_solo_random(env: Any, agent: str, rng: random.Random) -> str:
    _check_solo(agent)
    return rng.choice(_open_cells(env)) + str(rng.randint(1, env.size))


def sudoku_solo_fewest_candidates(env: Any, agent: str, rng: random.Random) -> str:
    _check_solo(agent)
    label = _fewest(env)
    return label + _candidate(env, env.cells[label], rng)


def sudoku_solo_optimal(env: Any, agent: str, rng: random.Random) -> str:
    _check_solo(agent)
    label = _fewest(env)
    r, c = env.cells[label]
    return label + str(env.solution[r][c])


SUDOKU_SOLO: dict[str, ReferencePolicy] = {
    "random": sudoku_solo_random,
    **{f"always_A{d}": _always(f"A{d}") for d in range(1, 5)},
    "fewest_candidates": sudoku_solo_fewest_candidates,
    "optimal": sudoku_solo_optimal,
}


# -- the tool + plan team ------------------------------------------------------------------------


def plan_path_turn(policy: ReferencePolicy) -> Turn:
    """One movers' turn of `policy` on a Plan-Path grid, as a list of moves (see the module docstring)."""

    def turn(env: Any, rng: random.Random) -> list[str]:
        view = SimpleNamespace(rows=env.rows, cols=env.cols, walls=env.walls, goal=env.goal, position=env.position)
        moves = []
        for agent in ("vertical", "horizontal"):
            if view.position == view.goal:
                break
            letter = policy(view, agent, rng)
            landing = _landing(view, PLAN_PATH_MOVES[agent][letter])
            if landing != view.position:
                view.position = landing
                moves.append(letter)
        return moves

    return turn


def sokoban_turn(policy: ReferencePolicy) -> Turn:
    """One movers' turn of `policy` on a Sokoban level, as a list of moves (see the module docstring)."""

    def turn(env: Any, rng: random.Random) -> list[str]:
        view = SimpleNamespace(board=env.board, start=env.start, state=env.state)
        moves = []
        for agent in SOKOBAN_AGENTS:
            if view.board.solved(view.state):
                break
            letter = policy(view, agent, rng)
            state, blocked = move(view.board, view.state, SOKOBAN_MOVES[agent][letter])
            if not blocked:
                view.state = state
                moves.append(letter)
        return moves

    return turn


def solver_turn(env: Any, rng: random.Random) -> Any:
    """The whole solution from here (`ToolPlanEnv.answer`)."""
    return env.answer()


def random_grid_turn(env: Any, rng: random.Random) -> list[list[int]]:
    """The grid with a random digit in every empty cell."""
    return [[d or rng.randint(1, env.size) for d in row] for row in env.grid]


def tool_plan(turn: Turn) -> ReferencePolicy:
    """The tool + plan team playing `turn`: the tool's program prints it, the plan adopts what the tool
    printed (alone, or when the program printed nothing, it plays `turn` itself)."""

    def policy(env: Any, agent: str, rng: random.Random) -> Any:
        if agent == "tool":
            return {"code": f"print({MARKER!r}, {turn(env, rng)!r})"}
        if agent == "plan":
            printed = env.tool_actions
            return printed if printed is not None else turn(env, rng)
        raise ValueError(f"tool_plan: a reference policy plays tool or plan, not {agent!r}")

    return policy


PLAN_PATH_TOOL_PLAN: dict[str, ReferencePolicy] = {
    **{name: tool_plan(plan_path_turn(policy)) for name, policy in PLAN_PATH.items()},
    "solver": tool_plan(solver_turn),
}
SOKOBAN_TOOL_PLAN: dict[str, ReferencePolicy] = {
    **{name: tool_plan(sokoban_turn(policy)) for name, policy in SOKOBAN.items()},
    "solver": tool_plan(solver_turn),
}
SUDOKU_TOOL_PLAN: dict[str, ReferencePolicy] = {
    "random": tool_plan(random_grid_turn),
    "solver": tool_plan(solver_turn),
}
