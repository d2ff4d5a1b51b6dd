"""Plan-Path movers for small instruct models (e.g. SmolLM2-135M-Instruct): short prompts, "Answer: X".

The same team as `nodes.plan_path` (the vertical mover plays U or D, then the horizontal mover L or R;
the same local reward), asked the way a 135M chat model can learn from: the rules in a short system
message, two worked exchanges whose answers differ, then the question in relative words about the
mover's own axis only ("G is 2 rows above A. Up: free. Down: wall."). The reply must hold exactly one
"Answer:" followed by exactly one of the mover's moves (the letter, or the word: "Answer: down" is D);
anything else ("Answer: U or D", two answers, "Answer: D maybe") is a parse error, a penalty candidate
counted in `parse/invalid_rate/<agent>`. Generation stops at the model's end-of-turn token; a
`max_tokens` of 6 holds "Answer: U" and that token.
"""

from __future__ import annotations

import re

from envs.plan_path import MOVES
from mas_async.api import ParseError
from nodes.plan_path import Mover

WORDS = {"U": "up", "D": "down", "L": "left", "R": "right"}
RULES = (
    "You steer a token A to a goal G on a grid, taking turns with a partner. You move A {words}; your "
    "partner moves it {partner}. Reply with one line: Answer: {letters}"
)
# Two worked exchanges with different answers: a small model copies the format from them, and a single
# example's answer would be copied too (greedy decoding then plays one constant move).
EXAMPLES = {
    "vertical": [
        ("G is 2 rows above A. Up: free. Down: free.", "U"),
        ("G is 1 row below A. Up: wall. Down: free.", "D"),
    ],
    "horizontal": [
        ("G is 1 column right of A. Left: free. Right: free.", "R"),
        ("G is 3 columns left of A. Left: free. Right: wall.", "L"),
    ],
}
POSITIONS = re.compile(r"A=(\d+),(\d+) G=(\d+),(\d+)")
ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)
SPECIAL = re.compile(r"<\|[^|]*\|>")  # an end-of-turn marker left in the text (<|im_end|>)
EDGES = " \t\r\n.!*`'\""  # what may surround the move: "Answer: **U**." is U


class AnswerMover(Mover):
    """A Plan-Path mover whose reply is "Answer: <move>"."""

    def prompt(self, obs: str) -> list[dict[str, str]]:
        partner = "horizontal" if self.agent == "vertical" else "vertical"
        rules = RULES.format(
            words=" or ".join(f"{WORDS[m]} ({m})" for m in self.moves),
            partner=" or ".join(WORDS[m] for m in MOVES[partner] if m != "S"),
            letters=" or ".join(self.moves),
        )
        return answer_prompt(rules, EXAMPLES[self.agent], describe(obs, self.agent))

    def parse(self, text: str) -> str:
        return answer_move(text, self.moves, self.agent)


def answer_prompt(rules: str, examples: list[tuple[str, str]], question: str) -> list[dict[str, str]]:
    """The rules, the worked exchanges (question, move), then the question."""
    messages = [{"role": "system", "content": rules}]
    for example, move in examples:
        messages += [{"role": "user", "content": example}, {"role": "assistant", "content": f"Answer: {move}"}]
    return messages + [{"role": "user", "content": question}]


def describe(obs: str, agent: str) -> str:
    """Where the goal lies along `agent`'s axis, and whether each of its moves is free, in words, from the
    env's observation (role letter, grid rows, "A=r,c G=r,c")."""
    lines = obs.strip().splitlines()
    found = POSITIONS.fullmatch(lines[-1].strip()) if lines else None
    if found is None:
        raise ValueError(f"plan_path observation without an 'A=r,c G=r,c' line: {obs!r}")
    ar, ac, gr, gc = (int(v) for v in found.groups())
    grid = lines[1:-1]
    if agent == "vertical":
        where = _relative(gr - ar, "row", "above", "below", "in the same row as A")
        moves = (("Up", (ar - 1, ac)), ("Down", (ar + 1, ac)))
    elif agent == "horizontal":
        where = _relative(gc - ac, "column", "left of", "right of", "in the same column as A")
        moves = (("Left", (ar, ac - 1)), ("Right", (ar, ac + 1)))
    else:
        raise ValueError(f"plan_path: unknown agent {agent!r}: agents are vertical, horizontal")
    free = " ".join(f"{name}: {'free' if _free(grid, cell) else 'wall'}." for name, cell in moves)
    return f"G is {where}. {free}"


def _relative(delta: int, unit: str, before: str, after: str, same: str) -> str:
    if delta == 0:
        return same
    count = f"{abs(delta)} {unit}{'s' if abs(delta) > 1 else ''}"
    return f"{count} {before if delta < 0 else after} A"


def _free(grid: list[str], cell: tuple[int, int]) -> bool:
    r, c = cell
    return 0 <= r < len(grid) and 0 <= c < len(grid[r]) and grid[r][c] != "#"


def answer_move(text: str, moves: tuple[str, ...], who: str) -> str:
    """The move of a reply holding exactly one "Answer:" followed by exactly one of `moves` (its capital
    letter, or its word in any case) and nothing else but whitespace and emphasis; else a ParseError."""
    parts = ANSWER.split(SPECIAL.sub("", text))
    if len(parts) != 2:
        found = "no" if len(parts) < 2 else f"{len(parts) - 1}"
        raise ParseError(f"{who}: {found} 'Answer:' in the reply {text[-40:]!r}; exactly one is expected")
    answer = parts[1].strip(EDGES)
    if answer in moves:
        return answer
    for move in moves:
        if answer.lower() == WORDS[move]:
            return move
    raise ParseError(f"{who}: 'Answer:' must be followed by exactly one of {', '.join(moves)}, got {parts[1][:40]!r}")


class AnswerVerticalMover(AnswerMover):
    def __init__(self, agent: str = "vertical") -> None:
        super().__init__(agent)


class AnswerHorizontalMover(AnswerMover):
    def __init__(self, agent: str = "horizontal") -> None:
        super().__init__(agent)
