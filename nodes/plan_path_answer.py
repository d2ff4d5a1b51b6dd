"""Plan-Path movers for small instruct models (e.g. SmolLM2-135M-Instruct): short prompts, "Answer: X".

The same team as `nodes.plan_path` (the vertical mover plays U or D, then the horizontal mover L or R;
the same local reward), asked the way a small chat model can follow: the rules in a short system
message, the grid and the positions in words in the user message, and the reply's move after the last
"Answer:" (a letter standing alone, or the word: "Answer: down" is D). A reply without one, or whose
last answer is not this mover's move, is a parse error (a penalty candidate, counted in the
`parse/invalid_rate/<agent>` metric). Pair it with a `max_tokens` of a few dozen: generation stops at
the model's end-of-turn token.
"""

from __future__ import annotations

import re

from envs.plan_path import MOVES
from mas_async.api import ParseError
from nodes.plan_path import Mover

WORDS = {"U": "up", "D": "down", "L": "left", "R": "right"}
AXIS = {"vertical": "row", "horizontal": "column"}
RULES = (
    "You move a token A on a grid to the goal G, taking turns with a partner. '#' is a wall. "
    "Rows are numbered from 0 at the top, columns from 0 at the left. You may only move {words}; "
    "your partner moves {partner}. Reply with one line: Answer: {letters}"
)
# One worked exchange before the real question: a 135M model copies the reply format from it.
EXAMPLE = {
    "vertical": "..G.\n....\n.A..\n....\nA is in row 2, column 1. G is in row 0, column 2.",
    "horizontal": "....\n.A..\n....\nG...\nA is in row 1, column 1. G is in row 3, column 0.",
}
POSITIONS = re.compile(r"A=(\d+),(\d+) G=(\d+),(\d+)")
ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)


class AnswerMover(Mover):
    """A Plan-Path mover whose reply ends with "Answer: <move>"."""

    def prompt(self, obs: str) -> list[dict[str, str]]:
        partner = "horizontal" if self.agent == "vertical" else "vertical"
        rules = RULES.format(
            words=" or ".join(f"{WORDS[m]} ({m})" for m in self.moves),
            partner=" or ".join(WORDS[m] for m in MOVES[partner] if m != "S"),
            letters=" or ".join(self.moves),
        )
        return answer_prompt(rules, EXAMPLE[self.agent], self.moves[0], describe(obs))

    def parse(self, text: str) -> str:
        return answer_move(text, self.moves, self.agent)


def answer_prompt(rules: str, example: str, example_move: str, question: str) -> list[dict[str, str]]:
    """The rules, one worked exchange (a small model copies the reply format from it), then the question."""
    return [
        {"role": "system", "content": rules},
        {"role": "user", "content": example},
        {"role": "assistant", "content": f"Answer: {example_move}"},
        {"role": "user", "content": question},
    ]


def describe(obs: str) -> str:
    """The env's observation (role letter, grid rows, "A=r,c G=r,c") as the grid and one sentence."""
    lines = obs.strip().splitlines()
    found = POSITIONS.fullmatch(lines[-1].strip())
    if found is None:
        raise ValueError(f"plan_path observation without an 'A=r,c G=r,c' line: {obs!r}")
    ar, ac, gr, gc = found.groups()
    grid = "\n".join(lines[1:-1])
    return f"{grid}\nA is in row {ar}, column {ac}. G is in row {gr}, column {gc}."


def answer_move(text: str, moves: tuple[str, ...], who: str) -> str:
    """The move after the last "Answer:" of `text`: its last standalone move letter or move word."""
    parts = ANSWER.split(text)
    if len(parts) < 2:
        raise ParseError(f"{who}: no 'Answer:' in the reply {text[-40:]!r}")
    names = {m: m for m in moves} | {WORDS[m]: m for m in moves}
    found = re.findall(r"\b(" + "|".join(names) + r")\b", parts[-1], flags=re.IGNORECASE)
    found = [f for f in found if f in moves or f.lower() in names]  # letters must be capitals
    if not found:
        raise ParseError(f"{who}: no {' or '.join(moves)} after 'Answer:' in {parts[-1][:40]!r}")
    last = found[-1]
    return names[last] if last in moves else names[last.lower()]


class AnswerVerticalMover(AnswerMover):
    def __init__(self, agent: str = "vertical") -> None:
        super().__init__(agent)


class AnswerHorizontalMover(AnswerMover):
    def __init__(self, agent: str = "horizontal") -> None:
        super().__init__(agent)
