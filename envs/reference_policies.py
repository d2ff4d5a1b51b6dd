"""What the games' reference policies share: tie-breaking, the movers' and the solo agent's moves, the
policies every movers' or solo game has (uniform random, a constant answer).

A reference policy is `(env, agent, rng) -> action` (`mas_async.api.ReferencePolicy`): the action `agent`
plays in `env`'s current state, of the kind its node's `parse` returns. The run plays each one through its
own workflow and nodes' rewards on the held-out problems (`eval/baseline/<name>/...`, its expectation: exact
where its `rng` choices can be enumerated, mas_async/rollout/baseline.py), so a policy that
learned nothing shows up as one of these lines (docs/evaluation.md). Each env names its own set in
`reference_policies()`, beside the rules they play by: `envs/plan_path.py`, `plan_path_solo.py`,
`sokoban.py`, `sokoban_solo.py`, `sudoku.py`, `sudoku_solo.py`, `tool_plan.py`. This module imports no env,
so the arrows point one way: each env imports from here, never back.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from mas_async.api import ReferencePolicy

MOVERS = ("vertical", "horizontal")
"""The agents of a movers' game (Plan-Path, Sokoban)."""


def ties(moves: list[str], score: Callable[[str], float], rng: random.Random) -> str:
    """One of the moves with the lowest score, chosen by `rng`."""
    scores = {m: score(m) for m in moves}
    best = min(scores.values())
    return rng.choice([m for m in moves if scores[m] == best])


def mover_moves(moves: Mapping[str, Mapping[str, Any]], agent: str) -> list[str]:
    """The moves a mover's reference policy plays: its letters in the game's `moves`, never "S" (the shipped
    movers never stay)."""
    if agent not in MOVERS:
        raise ValueError(f"a movers' reference policy plays vertical or horizontal, not {agent!r}")
    return [m for m in moves[agent] if m != "S"]


def movers_random(moves: Mapping[str, Mapping[str, Any]]) -> ReferencePolicy:
    """Uniform over the mover's moves."""

    def uniform(env: Any, agent: str, rng: random.Random) -> str:
        return rng.choice(mover_moves(moves, agent))

    return uniform


def movers_constant(moves: Mapping[str, Mapping[str, Any]], vertical: str, horizontal: str) -> ReferencePolicy:
    """The constant team answer: `vertical` for the vertical mover, `horizontal` for the other (a collapsed policy)."""

    def always(env: Any, agent: str, rng: random.Random) -> str:
        mover_moves(moves, agent)
        return vertical if agent == "vertical" else horizontal

    return always


def check_solo(agent: str) -> None:
    if agent != "solo":
        raise ValueError(f"a solo reference policy plays the agent 'solo', not {agent!r}")


def solo_moves(moves: Iterable[str], agent: str) -> list[str]:
    """The solo agent's moves (`agent` checked first)."""
    check_solo(agent)
    return list(moves)


def solo_random(moves: Iterable[str]) -> ReferencePolicy:
    """Uniform over the solo agent's moves."""
    letters = list(moves)

    def uniform(env: Any, agent: str, rng: random.Random) -> str:
        return rng.choice(solo_moves(letters, agent))

    return uniform


def solo_always(action: str) -> ReferencePolicy:
    """A solo agent's constant answer."""

    def always(env: Any, agent: str, rng: random.Random) -> str:
        check_solo(agent)
        return action

    return always
