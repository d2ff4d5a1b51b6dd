"""Nodes and workflow for Sudoku (`envs.sudoku`): a chooser picks a cell, a placer writes its digit.

Each turn the chooser names an open cell by its letter ("B"; the env labels every empty cell of the
puzzle with a letter); then, if the choice was an open cell, the placer names the digit for it ("4").
Both answers are one character, which a tiny model can emit from the start. Neither has a no-op: the
chooser must name a cell and the placer a digit. The team needs both: a placer only ever sees the cell
it was given, and a chosen cell only fills if the placer finds its digit.

Local rewards are dense and need no search:
- chooser: `1 / number of candidate digits` of the chosen cell (1.0 for a cell whose digit is forced by
  its row, column and box, less for an ambiguous one); a filled cell or an unused letter gets
  `invalid_penalty`.
- placer: +1.0 for the solution's digit (it is written); 0.0 for a digit that breaks no rule but is
  not the solution's (it is not written); `invalid_penalty` for a digit already in the cell's row,
  column or box, or out of range.
The team reward is 1.0 when the grid is full. Unparsable answers get `invalid_penalty` too.

The plain nodes suit the tiny character model (one-character answers, the bare observation). The
`Chat*` nodes suit chat LLMs such as Qwen3: the rules come as a system message, and the answer is the
last one standing alone in the reply, after any <think> block.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from envs.sudoku import LABELS
from mas_async.api import Node, ParseError, Workflow
from nodes.parsing import strip_thinking

if TYPE_CHECKING:
    from envs.sudoku import SudokuEnv
    from mas_async.api import EpisodeContext as Episode

DIGITS = "123456789"


class CellChooser(Node):
    """Names the open cell to fill next by its letter ("B")."""

    def __init__(self, agent: str = "chooser") -> None:
        super().__init__(agent)

    def parse(self, text: str) -> str:
        answer = text.strip()[:1]
        if not answer or answer not in LABELS:
            raise ParseError(f"{self.agent}: expected a cell letter A-Z first, got {text[:20]!r}")
        return answer

    def local_reward(self, before: SudokuEnv, action: Any, after: SudokuEnv) -> float:
        if after.infos[self.agent]["invalid"]:
            return self.invalid_penalty
        return 1.0 / len(before.candidates(before.cells[action]))


class DigitPlacer(Node):
    """Names the digit for the chosen cell ("4")."""

    def __init__(self, agent: str = "placer") -> None:
        super().__init__(agent)

    def parse(self, text: str) -> str:
        answer = text.strip()[:1]
        if not answer or answer not in DIGITS:
            raise ParseError(f"{self.agent}: expected a digit 1-9 first, got {text[:20]!r}")
        return answer

    def local_reward(self, before: SudokuEnv, action: Any, after: SudokuEnv) -> float:
        if after.infos[self.agent]["correct"]:
            return 1.0
        legal = before.selected is not None and int(action) in before.candidates(before.selected)
        return 0.0 if legal else self.invalid_penalty


RULES = """You are the {agent} of a two-agent Sudoku team. Each row, column and box must hold every
digit once. Rows are numbered at the left; each empty cell shows its own letter (A, B, C, ...).
Each turn the chooser picks an empty cell, then the placer writes its digit; a wrong digit is refused.
{task}"""
CHOOSER_TASK = "Pick the empty cell whose digit is easiest to deduce. Reply with its letter only, e.g. B."
PLACER_TASK = "The selected cell follows AT=, then its row, column and box. Reply with its digit only, e.g. 4."


def final_answer(text: str, pattern: str) -> str | None:
    """The last match of `pattern` standing alone (as a word) in `text` after any <think> block, or None (also
    when it stands only inside an unfinished <think> block: a reply cut at max_tokens made no choice)."""
    found = re.findall(rf"\b{pattern}\b", strip_thinking(text))
    return found[-1] if found else None


class ChatCellChooser(CellChooser):
    """The chooser for chat LLMs: the last standalone capital letter of the reply."""

    def prompt(self, obs: str) -> list[dict[str, str]]:
        rules = RULES.format(agent="chooser", task=CHOOSER_TASK)
        return [{"role": "system", "content": rules}, {"role": "user", "content": obs}]

    def parse(self, text: str) -> str:
        answer = final_answer(text, r"([A-Z])")
        if answer is None:
            raise ParseError(f"{self.agent}: no standalone cell letter in the reply {text[-40:]!r}")
        return answer


class ChatDigitPlacer(DigitPlacer):
    """The placer for chat LLMs: the last standalone digit of the reply."""

    def prompt(self, obs: str) -> list[dict[str, str]]:
        rules = RULES.format(agent="placer", task=PLACER_TASK)
        return [{"role": "system", "content": rules}, {"role": "user", "content": obs}]

    def parse(self, text: str) -> str:
        answer = final_answer(text, r"([1-9])")
        if answer is None:
            raise ParseError(f"{self.agent}: no digit in the reply {text[-40:]!r}")
        return answer


class SudokuWorkflow(Workflow):
    """Each turn the chooser acts, then the placer if the chooser selected a cell; the episode stops
    when the grid is full or after `max_turns` turns."""

    agents = ("chooser", "placer")

    def __init__(self, nodes: dict[str, Node], max_turns: int = 8) -> None:
        super().__init__(nodes)
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"SudokuWorkflow: max_turns must be a positive integer, got {max_turns!r}")
        self.max_turns = max_turns

    async def run(self, episode: Episode) -> None:
        for _ in range(self.max_turns):
            if episode.env.done:
                return
            await episode.act(self.nodes["chooser"])
            if episode.env.selected is not None and not episode.env.done:
                await episode.act(self.nodes["placer"])
            episode.next_turn()
