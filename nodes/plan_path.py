"""Nodes and workflow for Plan-Path (`envs.plan_path`): a vertical and a horizontal mover take turns.

Each turn both movers must move: the vertical mover plays "U" or "D", then the horizontal mover "L" or
"R" (the env's "S" is not theirs to play). A free choice to stay would be a trap for learning: staying
is right whenever the mover's axis is already aligned with the goal, so an untrained policy drifts to
"S" everywhere before it learns to read the grid, and a group of K stays carries no signal. With forced
moves, a mover that is aligned loses a step whatever it plays (no signal either way) and a mover that is
not aligned always has a better and a worse move. The team still reaches every generated goal: problems
are checked solvable under these rules (see `envs.plan_path.team_moves`).

Each node's prompt is the env's observation as one user message; its answer is valid when the first
non-blank character is one of its moves. Its local reward is the progress its move made:
`distance(before) - distance(after)`, or `invalid_penalty` when the move was blocked by a wall or the
grid's edge. Since generated problems have the start and goal in different rows and columns, the team
only reaches the goal if both movers do their part.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from envs.plan_path import MOVES
from mas_async.api import Node, ParseError, Workflow
from nodes.parsing import strip_thinking, unfinished_thinking
from nodes.sequential import SequentialWorkflow

if TYPE_CHECKING:
    from envs.plan_path import PlanPathEnv
    from mas_async.api import EpisodeContext as Episode


class Mover(Node):
    """A Plan-Path role: one of the env's agents, with that agent's moves."""

    def __init__(self, agent: str) -> None:
        if agent not in MOVES:
            raise ValueError(f"plan_path: unknown agent {agent!r}: agents are {', '.join(MOVES)}")
        super().__init__(agent)
        self.moves = tuple(move for move in MOVES[agent] if move != "S")

    def parse(self, text: str) -> str:
        stripped = text.strip()
        if not stripped or stripped[0] not in self.moves:
            raise ParseError(f"{self.agent}: expected one of {', '.join(self.moves)} first, got {text[:20]!r}")
        return stripped[0]

    def local_reward(self, before: PlanPathEnv, action: Any, after: PlanPathEnv) -> float:
        if after.infos[self.agent]["blocked"]:
            return self.invalid_penalty
        return float(before.distance() - after.distance())


class VerticalMover(Mover):
    """Moves the token up ("U") or down ("D")."""

    def __init__(self, agent: str = "vertical") -> None:
        super().__init__(agent)


class HorizontalMover(Mover):
    """Moves the token left ("L") or right ("R")."""

    def __init__(self, agent: str = "horizontal") -> None:
        super().__init__(agent)


CHAT_RULES = (
    "You and a partner steer one token A through a grid to the goal G. '#' is a wall, '.' is free; "
    "rows are numbered from 0 at the top, columns from 0 at the left, and the last line gives the "
    "positions as row,column. You are the {agent} mover: you must move the token {names}. Your partner "
    "moves it {partner}. A move into a wall or off the grid wastes the move. Think briefly, then end your "
    "reply with exactly one letter: {letters}."
)
MOVE_NAMES = {"U": "up (U)", "D": "down (D)", "L": "left (L)", "R": "right (R)"}


class ChatMover(Mover):
    """A Plan-Path mover for chat LLMs (e.g. Qwen3): the rules as a system message; the answer is the
    last standalone move letter of the reply, after any <think> block."""

    def prompt(self, obs: str) -> list[dict[str, str]]:
        partner = "horizontal" if self.agent == "vertical" else "vertical"
        rules = CHAT_RULES.format(
            agent=self.agent,
            names=" or ".join(MOVE_NAMES[m] for m in self.moves),
            partner=" or ".join(MOVE_NAMES[m] for m in MOVES[partner] if m != "S"),
            letters=" or ".join(self.moves),
        )
        return [{"role": "system", "content": rules}, {"role": "user", "content": obs}]

    def parse(self, text: str) -> str:
        return last_move(text, self.moves, self.agent)


def last_move(text: str, moves: tuple[str, ...], who: str) -> str:
    """A chat model's move: the last standalone move letter of the reply after any </think> block. A letter
    only inside an unfinished <think> block (a reply cut at max_tokens) is no move: a ParseError."""
    answer = strip_thinking(text)
    found = re.findall(rf"\b([{''.join(moves)}])\b", answer)
    if not found:
        where = "the reply ends inside an unfinished <think> block" if unfinished_thinking(text) else "the reply"
        raise ParseError(f"{who}: no standalone {' or '.join(moves)} after the thinking; {where}: {text[-40:]!r}")
    return found[-1]


class ChatVerticalMover(ChatMover):
    def __init__(self, agent: str = "vertical") -> None:
        super().__init__(agent)


class ChatHorizontalMover(ChatMover):
    def __init__(self, agent: str = "horizontal") -> None:
        super().__init__(agent)


class PlanPathWorkflow(SequentialWorkflow):
    """Each turn the vertical mover acts, then the horizontal mover acts on the state after the vertical
    mover's committed move; the episode stops on the goal or after `max_turns` turns (default 8)."""

    agents = ("vertical", "horizontal")


class SoloMover(Node):
    """The single-agent baseline's only node: one move in any direction ("U", "D", "L" or "R")."""

    moves = ("U", "D", "L", "R")

    def __init__(self, agent: str = "solo") -> None:
        super().__init__(agent)

    def parse(self, text: str) -> str:
        stripped = text.strip()
        if not stripped or stripped[0] not in self.moves:
            raise ParseError(f"{self.agent}: expected one of U, D, L, R first, got {text[:20]!r}")
        return stripped[0]

    def local_reward(self, before: PlanPathEnv, action: Any, after: PlanPathEnv) -> float:
        if after.infos[self.agent]["blocked"]:
            return self.invalid_penalty
        return float(before.distance() - after.distance())


class PlanPathSoloWorkflow(Workflow):
    """One agent moves each step until the goal or `max_moves` moves (the single-agent baseline; the
    team's `max_turns` turns hold two moves each, so compare with max_moves = 2 * max_turns)."""

    agents = ("solo",)

    def __init__(self, nodes: dict[str, Node], max_moves: int = 16) -> None:
        super().__init__(nodes)
        if not isinstance(max_moves, int) or max_moves < 1:
            raise ValueError(f"{type(self).__name__}: max_moves must be a positive integer, got {max_moves!r}")
        self.max_moves = max_moves

    async def run(self, episode: Episode) -> None:
        for _ in range(self.max_moves):
            if episode.env.done:
                return
            await episode.act(self.nodes["solo"])
            episode.next_turn()
