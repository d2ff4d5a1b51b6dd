"""Plan-Path movers that read the grid: the state in the prompt, never the answer.

The team of `nodes.plan_path` (the vertical mover plays U or D, then the horizontal mover L or R; the
same local reward), asked as Stronger-MAS shows Plan-Path to its models: the grid as text, one cell a
token ("." free, "#" wall, "A" the token, "G" the goal), and where A and G are as row and column numbers,
rows counted from 0 at the top and columns from 0 at the left. Nothing says where the goal lies from A
("above", "2 rows below") or whether a move is free, and no worked example shows a position with its
answer: the mover must read the numbers (or the grid) to know which way to go, and the walls to know
what is blocked. The prompt ends with the reply's first word, "Answer:", which the model continues (a
135M chat model asked for that format without a worked example almost never writes it; held to it, a
third of its first replies are a move). The reply is read as `nodes.plan_path_answer.answer_move` reads
"Answer:" and what follows: exactly one of the mover's moves, else a parse error (a penalty candidate).
`SoloGridMover` is the single-agent baseline: the same prompt, any of the four moves.
"""

from __future__ import annotations

import re

from envs.plan_path import MOVES
from nodes.plan_path import Mover, SoloMover
from nodes.plan_path_answer import WORDS, answer_move

RULES = (
    "{team}'#' is a wall and '.' is free. Rows are numbered from 0 at the top, columns from 0 at the "
    "left. You move A {words}.{partner} A move into a wall or off the grid is wasted. Reply with one "
    "line: {replies}"
)
TEAM = "You and a partner take turns to steer the token A to the goal G on a grid. "
SOLO = "You steer the token A to the goal G on a grid, one move at a time. "
REPLY_START = "Answer:"
"""The start of the assistant's reply, given in the prompt: the model writes what follows it."""
POSITIONS = re.compile(r"A=(\d+),(\d+) G=(\d+),(\d+)")


def rules(moves: tuple[str, ...], partner_moves: tuple[str, ...] = ()) -> str:
    """The system message: the grid's legend and numbering, the mover's moves (and its partner's), the reply."""
    named = [f"{WORDS[m]} ({m})" for m in moves]
    words = f"{', '.join(named[:-1])} or {named[-1]}"
    partner = f" Your partner moves it {' or '.join(WORDS[m] for m in partner_moves)}." if partner_moves else ""
    replies = ", ".join(f"Answer: {m}" for m in moves[:-1]) + f" or Answer: {moves[-1]}"
    return RULES.format(team=TEAM if partner_moves else SOLO, words=words, partner=partner, replies=replies)


def grid_prompt(system: str, obs: str) -> list[dict[str, str]]:
    """The rules, the grid, then the reply's start for the model to continue."""
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": show_grid(obs)},
        {"role": "assistant", "content": REPLY_START},
    ]


def read_answer(text: str, moves: tuple[str, ...], who: str) -> str:
    """The move of a completion that continues `REPLY_START` (`answer_move` over the whole reply)."""
    return answer_move(REPLY_START + text, moves, who)


def show_grid(obs: str) -> str:
    """The user message from the env's observation (role letter, grid rows, "A=r,c G=r,c"): the grid with
    one space before each cell (one token per cell for BPE tokenizers), then A's and G's row and column."""
    lines = obs.strip().splitlines()
    found = POSITIONS.fullmatch(lines[-1].strip()) if len(lines) >= 3 else None
    if found is None:
        raise ValueError(f"plan_path observation without a grid and an 'A=r,c G=r,c' line: {obs!r}")
    ar, ac, gr, gc = found.groups()
    grid = ["".join(f" {cell}" for cell in row) for row in lines[1:-1]]
    return "\n".join([*grid, f"A: row {ar}, column {ac}. G: row {gr}, column {gc}."])


class GridMover(Mover):
    """A Plan-Path mover shown the grid and the positions; its reply is "Answer: <move>"."""

    def prompt(self, obs: str) -> list[dict[str, str]]:
        partner = "horizontal" if self.agent == "vertical" else "vertical"
        partner_moves = tuple(m for m in MOVES[partner] if m != "S")
        return grid_prompt(rules(self.moves, partner_moves), obs)

    def parse(self, text: str) -> str:
        return read_answer(text, self.moves, self.agent)


class GridVerticalMover(GridMover):
    def __init__(self, agent: str = "vertical") -> None:
        super().__init__(agent)


class GridHorizontalMover(GridMover):
    def __init__(self, agent: str = "horizontal") -> None:
        super().__init__(agent)


class SoloGridMover(SoloMover):
    """The single agent of `plan_path_solo`, shown the same grid: any of U, D, L, R, as "Answer: <move>"."""

    def prompt(self, obs: str) -> list[dict[str, str]]:
        return grid_prompt(rules(self.moves), obs)

    def parse(self, text: str) -> str:
        return read_answer(text, self.moves, self.agent)
