"""Nodes and workflow for Sokoban (`envs.sokoban`): a vertical and a horizontal pusher take turns.

The team steers one warehouse keeper, as in Plan-Path: each turn the vertical pusher plays "U" or "D",
then the horizontal pusher "L" or "R" on the state after the vertical pusher's committed move. Neither
may stay, for the reason given in nodes/plan_path.py (a free no-op is where an untrained policy
collapses); the generator only keeps levels the alternating team can solve (`envs.sokoban.team_moves`).

Each node's prompt is the env's observation as one user message; its answer is valid when the first
non-blank character is one of its moves. Its local reward is the progress its move made towards a
solution: `before.distance(me) - after.distance(partner)`, the fewest team moves left before and after
(with the partner moving next). That is +1 for a move on a shortest team solution and 0 or less for any
other; a bump into a wall is graded the same way, so it only pays when waiting is what the team must
do. A move that deadlocks the level (no solution is left) gets `invalid_penalty`. The team reward is
the fraction of boxes on targets, 1.0 when solved.

The plain nodes suit the tiny character model (one-letter answers, the bare observation). The `Chat*`
nodes suit chat LLMs such as Qwen3: the rules come as a system message, and the answer is the last move
letter standing alone in the reply, after any <think> block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from envs.sokoban import AGENTS, MOVES
from mas_async.api import Node, ParseError
from nodes.plan_path import last_move
from nodes.sequential import SequentialWorkflow

if TYPE_CHECKING:
    from envs.sokoban import SokobanEnv


class Pusher(Node):
    """A Sokoban role: one of the env's two movers, with that mover's moves."""

    def __init__(self, agent: str) -> None:
        if agent not in MOVES:
            raise ValueError(f"sokoban: unknown agent {agent!r}: agents are {', '.join(AGENTS)}")
        super().__init__(agent)
        self.moves = tuple(MOVES[agent])
        self.partner = AGENTS[1 - AGENTS.index(agent)]

    def parse(self, text: str) -> str:
        stripped = text.strip()
        if not stripped or stripped[0] not in self.moves:
            raise ParseError(f"{self.agent}: expected one of {', '.join(self.moves)} first, got {text[:20]!r}")
        return stripped[0]

    def local_reward(self, before: SokobanEnv, action: Any, after: SokobanEnv) -> float:
        left_before, left_after = before.distance(self.agent), after.distance(self.partner)
        if left_before is None or left_after is None:
            return self.invalid_penalty
        return float(left_before - left_after)


class VerticalPusher(Pusher):
    """Moves the keeper up ("U") or down ("D"), pushing any box in the way."""

    def __init__(self, agent: str = "vertical") -> None:
        super().__init__(agent)


class HorizontalPusher(Pusher):
    """Moves the keeper left ("L") or right ("R"), pushing any box in the way."""

    def __init__(self, agent: str = "horizontal") -> None:
        super().__init__(agent)


RULES = """You are the {agent} mover of a two-agent Sokoban team steering one warehouse keeper.
Legend: # wall, . floor, A keeper, B box, T target, X box on a target, Y keeper on a target.
The last line gives row,column coordinates counted from 0 at the top left.
You move the keeper {names}; your partner moves it {partner_names}; you take turns, and nobody may stay.
Walking into a box pushes it one cell if the cell beyond is free. Put every box on a target.
Reply with one letter: {letters}."""
MOVE_NAMES = {"U": "up", "D": "down", "L": "left", "R": "right"}


class ChatPusher(Pusher):
    """A Pusher for chat LLMs: the rules as a system message; the answer is the last standalone move
    letter of the reply after any <think> block."""

    def prompt(self, obs: str) -> list[dict[str, str]]:
        names = " or ".join(f"{MOVE_NAMES[m]} ({m})" for m in self.moves)
        partner = " or ".join(f"{MOVE_NAMES[m]} ({m})" for m in MOVES[self.partner])
        rules = RULES.format(agent=self.agent, names=names, partner_names=partner, letters=" or ".join(self.moves))
        return [{"role": "system", "content": rules}, {"role": "user", "content": obs}]

    def parse(self, text: str) -> str:
        return last_move(text, self.moves, self.agent)


class ChatVerticalPusher(ChatPusher):
    """The vertical pusher for chat LLMs."""

    def __init__(self, agent: str = "vertical") -> None:
        super().__init__(agent)


class ChatHorizontalPusher(ChatPusher):
    """The horizontal pusher for chat LLMs."""

    def __init__(self, agent: str = "horizontal") -> None:
        super().__init__(agent)


class SokobanWorkflow(SequentialWorkflow):
    """Each turn the vertical pusher acts, then the horizontal pusher on the state after the vertical
    pusher's committed move; the episode stops when the level is solved or deadlocked, or after
    `max_turns` turns (default 10)."""

    agents = AGENTS

    def __init__(self, nodes: dict[str, Node], max_turns: int = 10) -> None:
        super().__init__(nodes, max_turns)
