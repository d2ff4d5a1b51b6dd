"""Nodes and workflows of the single-agent baselines for Sokoban, Sudoku, Code and Math.

Each baseline is one agent, "solo", played by one node with one policy on the env's solo subclass
(`envs/<env>_solo.py`), so that every team result has a "single agent" row to compare with; Plan-Path's
baseline is in nodes/plan_path.py. The nodes reuse the team nodes' parsing and rewards:

- Sokoban, `SoloPusher`: the answer is one of U, D, L, R first (Plan-Path's `SoloMover`); the local
  reward is graded as the team pushers' is, by progress: `before.distance() - after.distance()` in free
  moves (+1 for a move on a shortest solution, 0 for a bump, less for a detour), `invalid_penalty` for a
  move that deadlocks the level. `SokobanSoloWorkflow`: one move per step, up to `max_moves`; compare
  with max_moves = 2 * the team's max_turns, since a team turn holds two moves.
- Sudoku, `SoloPlacer`: the answer is a cell letter then its digit, "B3", in one action; the local
  reward is the team chooser's reward for the letter (1 / the cell's candidate digits, or the penalty
  for a letter that names no open cell, which ends the scoring) plus the team placer's for the digit
  (+1 for the solution's digit, 0 for a digit that breaks no rule, the penalty otherwise), the placer's
  scored on the state where the cell is selected. `SudokuSoloWorkflow`: one placement per step, up to
  `max_moves`; compare with max_moves = the team's max_turns, since a team turn is one placement too.
- Code, `SoloCoder`: the team coder's answer (one ```python block) and reward (the ground-truth pass
  ratio), with a system prompt that has no tester. Math, `SoloReasoner`: the team reasoner's answer
  (\\boxed{}) and reward (1.0 when correct), with a system prompt that has no tool-user. Their workflows
  are the team's parallel workflow with one agent: one answer per turn, up to `max_turns` (the same
  number as the team's, whose turn is one round of both agents answering at once).

Why Sudoku is one two-character action and not a choose step then a place step by the same agent: those
two steps by one policy would be the team's role-sharing run (configs/sudoku_tiny_shared.yaml: one
policy, the same two observations and rewards) under another name, not a new row. With one action, the
single agent makes both decisions at once, and the tiny character model can still learn it: its
observation carries, for every open cell, the line the team's placer reads (row, column, box), so the
digit it writes right after a letter is read from that letter's line as the placer reads it; the
reward is dense (the chooser's part alone already ranks the letters), and once answers have the form,
a group of K already holds right placements (a random digit is right with probability 1 / size).

Unparsable answers get `invalid_penalty`. The plain Sokoban and Sudoku nodes suit the tiny character
model (the bare observation, answers first); the `Chat*` ones suit chat LLMs such as Qwen3 (the rules
as a system message, the answer read last, after any <think> block). The code and math nodes already
prompt as chat models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mas_async.api import Node, ParseError
from nodes.code import Coder
from nodes.math import Reasoner
from nodes.parallel import ParallelWorkflow
from nodes.plan_path import PlanPathSoloWorkflow, SoloMover
from nodes.sudoku import CellChooser, DigitPlacer, final_answer

if TYPE_CHECKING:
    from envs.sokoban_solo import SokobanSoloEnv
    from envs.sudoku_solo import SudokuSoloEnv

# -- Sokoban ----------------------------------------------------------------------------------------


class SoloPusher(SoloMover):
    """Moves the keeper in any direction ("U", "D", "L" or "R"), pushing any box in the way."""

    def local_reward(self, before: SokobanSoloEnv, action: Any, after: SokobanSoloEnv) -> float:
        left_before, left_after = before.distance(), after.distance()
        if left_before is None or left_after is None:
            return self.invalid_penalty
        return float(left_before - left_after)


SOKOBAN_RULES = """You play Sokoban alone, steering one warehouse keeper.
Legend: # wall, . floor, A keeper, B box, T target, X box on a target, Y keeper on a target.
The last line gives row,column coordinates counted from 0 at the top left.
Each reply moves the keeper one cell: up (U), down (D), left (L) or right (R).
Walking into a box pushes it one cell if the cell beyond is free. Put every box on a target.
Reply with one letter: U, D, L or R."""


class ChatSoloPusher(SoloPusher):
    """The solo pusher for chat LLMs: the last standalone move letter of the reply."""

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        return [{"role": "system", "content": SOKOBAN_RULES}, {"role": "user", "content": str(obs)}]

    def parse(self, text: str) -> str:
        answer = final_answer(text, r"([UDLR])")
        if answer is None:
            raise ParseError(f"{self.agent}: no standalone U, D, L or R in the reply {text[-40:]!r}")
        return answer


class SokobanSoloWorkflow(PlanPathSoloWorkflow):
    """One move per step until the level is solved or deadlocked, or after `max_moves` moves."""

    def __init__(self, nodes: dict[str, Node], max_moves: int = 20) -> None:
        super().__init__(nodes, max_moves=max_moves)


# -- Sudoku -----------------------------------------------------------------------------------------


class SoloPlacer(Node):
    """Names an open cell and its digit in one action ("B3"): the team's chooser and placer in one."""

    def __init__(self, agent: str = "solo") -> None:
        super().__init__(agent)
        self.chooser = CellChooser(agent)
        self.placer = DigitPlacer(agent)

    def parse(self, text: str) -> str:
        stripped = text.strip()
        try:
            return self.chooser.parse(stripped[:1]) + self.placer.parse(stripped[1:2])
        except ParseError:
            raise ParseError(
                f"{self.agent}: expected a cell letter then its digit, like B3, got {text[:20]!r}"
            ) from None

    def local_reward(self, before: SudokuSoloEnv, action: Any, after: SudokuSoloEnv) -> float:
        letter, digit = action
        chosen = self.chooser.local_reward(before, letter, after)
        if after.infos[self.agent]["invalid"]:
            return chosen  # nothing was placed
        return chosen + self.placer.local_reward(before.selecting(letter), digit, after)


SUDOKU_RULES = """You solve a Sudoku alone. Each row, column and box must hold every digit once.
Rows are numbered at the left; each empty cell shows its own letter (A, B, C, ...). Below the grid,
one line per empty cell gives AT= its letter, then its row, column and box.
Each reply fills one cell: the letter of an empty cell and its digit together, e.g. B3; a wrong digit
is refused. Pick the cell whose digit is easiest to deduce. Reply with the letter and the digit only."""


class ChatSoloPlacer(SoloPlacer):
    """The solo placer for chat LLMs: the last standalone letter-digit pair of the reply ("B3")."""

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        return [{"role": "system", "content": SUDOKU_RULES}, {"role": "user", "content": str(obs)}]

    def parse(self, text: str) -> str:
        answer = final_answer(text, r"([A-Z][1-9])")
        if answer is None:
            raise ParseError(f"{self.agent}: no standalone cell letter and digit like B3 in the reply {text[-40:]!r}")
        return answer


class SudokuSoloWorkflow(PlanPathSoloWorkflow):
    """One placement per step until the grid is full or after `max_moves` steps."""

    def __init__(self, nodes: dict[str, Node], max_moves: int = 8) -> None:
        super().__init__(nodes, max_moves=max_moves)


# -- Code and Math ----------------------------------------------------------------------------------

SOLO_CODER_SYSTEM = """You write code alone: nobody tests it for you. Read the task; when it is shown, read
your current code and improve it if it can be wrong.
Think step by step, then give your complete solution as ONE ```python code block at the end:
- for a function task, the complete function with any imports and helpers (do not call it);
- for a program task, a complete program that reads standard input and prints the answer."""

SOLO_REASONER_SYSTEM = """You solve a math problem alone, in text. Reason step by step. When your previous
answer and reasoning are shown, check them and correct any mistake.
End with your final answer, simplified, as \\boxed{ANSWER}."""


class SoloCoder(Coder):
    """Writes the program with no tester; the coder's parsing and reward (see the module docstring)."""

    def __init__(self, agent: str = "solo") -> None:
        super().__init__(agent)

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        return [{"role": "system", "content": SOLO_CODER_SYSTEM}, {"role": "user", "content": str(obs)}]


class SoloReasoner(Reasoner):
    """Solves in text with no tool; the reasoner's parsing and reward (see the module docstring)."""

    def __init__(self, agent: str = "solo") -> None:
        super().__init__(agent)

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        return [{"role": "system", "content": SOLO_REASONER_SYSTEM}, {"role": "user", "content": str(obs)}]


class CodeSoloWorkflow(ParallelWorkflow):
    """The code team's workflow with the solo coder alone: one program per turn."""

    agents = ("solo",)


class MathSoloWorkflow(ParallelWorkflow):
    """The math team's workflow with the solo reasoner alone: one answer per turn."""

    agents = ("solo",)
