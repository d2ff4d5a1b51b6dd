"""Sokoban pushers for small instruct models (e.g. SmolLM2-135M-Instruct): short prompts, "Answer: X".

The same team as `nodes.sokoban` (the vertical pusher plays U or D, then the horizontal pusher L or R;
the same local reward), asked the way `nodes.plan_path_answer` asks Plan-Path's movers: the rules in a
short system message, one worked exchange, the room and the positions in words in the user message, and
a reply holding exactly one "Answer:" followed by exactly one move (the letter, or the word). Anything
else is a parse error (a penalty candidate, counted in `parse/invalid_rate/<agent>`). Pair it with a
`max_tokens` of a few dozen: generation stops at the model's end-of-turn token.
"""

from __future__ import annotations

import re

from envs.sokoban import MOVES
from nodes.plan_path_answer import WORDS, answer_move, answer_prompt
from nodes.sokoban import Pusher

RULES = (
    "You steer a warehouse keeper A, taking turns with a partner. '#' is a wall, B a box, T a target, "
    "X a box on a target, Y the keeper on a target. Rows are numbered from 0 at the top, columns from 0 "
    "at the left. Walking into a box pushes it one cell if the cell beyond is free. Put every box on a "
    "target. You may only move {words}; your partner moves {partner}. Reply with one line: Answer: {letters}"
)
# One worked exchange before the real question: a 135M model copies the reply format from it.
EXAMPLE = {
    "vertical": "#####\n#.T.#\n#.B.#\n#.A.#\n#####\nA is in row 3, column 2. Boxes: row 2, column 2. "
    "Targets: row 1, column 2.",
    "horizontal": "######\n#TB.A#\n######\nA is in row 1, column 4. Boxes: row 1, column 2. Targets: row 1, column 1.",
}
COORD = re.compile(r"([ABT])=(\d+),(\d+)")


class AnswerPusher(Pusher):
    """A Sokoban pusher whose reply ends with "Answer: <move>"."""

    def prompt(self, obs: str) -> list[dict[str, str]]:
        rules = RULES.format(
            words=" or ".join(f"{WORDS[m]} ({m})" for m in self.moves),
            partner=" or ".join(WORDS[m] for m in MOVES[self.partner]),
            letters=" or ".join(self.moves),
        )
        return answer_prompt(rules, [(EXAMPLE[self.agent], self.moves[0])], describe(obs))

    def parse(self, text: str) -> str:
        return answer_move(text, self.moves, self.agent)


def describe(obs: str) -> str:
    """The env's observation (role letter, room rows, "A=r,c B=r,c ... T=r,c ...") as the room and one
    sentence per kind of thing."""
    lines = obs.strip().splitlines()
    coords = COORD.findall(lines[-1]) if len(lines) > 2 else []
    if not coords or coords[0][0] != "A":
        raise ValueError(f"sokoban observation without an 'A=r,c B=r,c ... T=r,c' line: {obs!r}")
    where = {kind: [f"row {r}, column {c}" for k, r, c in coords if k == kind] for kind in "ABT"}
    room = "\n".join(lines[1:-1])
    return f"{room}\nA is in {where['A'][0]}. Boxes: {'; '.join(where['B'])}. Targets: {'; '.join(where['T'])}."


class AnswerVerticalPusher(AnswerPusher):
    def __init__(self, agent: str = "vertical") -> None:
        super().__init__(agent)


class AnswerHorizontalPusher(AnswerPusher):
    def __init__(self, agent: str = "horizontal") -> None:
        super().__init__(agent)
