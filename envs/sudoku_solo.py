"""Sudoku for a single agent: the baseline the chooser + placer team (`envs.sudoku`) is compared against.

The same puzzles and rules as `envs.sudoku` (checked mode: only the solution's digit is written), but one
agent, "solo", makes both of the team's decisions in ONE action of two characters: the letter of an
open cell, then the digit for it ("B3"). The step is the chooser's step and then, if the letter names an
open cell, the placer's; `infos["solo"]` holds both outcomes, {"invalid": bool, "correct": bool}.

The observation is everything the team sees between them: the chooser's grid, then the placer's line
for every open cell (its row, column and box), so the digit of a chosen cell can be read as the team's
placer reads it:

    S
    1:AB34
    2:C412
    3:2143
    4:4321
    AT=A ROW=AB34 COL=AC24 BOX=ABC4
    AT=B ROW=AB34 COL=B413 BOX=ABC4
    AT=C ROW=C412 COL=AC24 BOX=ABC4
"""

from __future__ import annotations

import random
from typing import Any

from envs.reference_policies import check_solo, solo_always
from envs.sudoku import LABELS, SudokuEnv, candidate_digit, fewest_candidates_cell, open_cells
from mas_async.api import ReferencePolicy

DIGITS = "0123456789"  # what the placer's step accepts (0 is never a solution's digit)


class SudokuSoloEnv(SudokuEnv):
    """One agent names a cell and its digit in one action: see the module docstring."""

    actions = {"solo": 'a letter and a digit, e.g. "B3": the open cell B gets digit 3 if it is the solution\'s'}
    info_keys = {"solo": {"invalid": "the letter named no open cell", "correct": "the digit was written"}}

    possible_agents = ["solo"]

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        super().reset(seed=seed, options=options)
        self.infos = {"solo": {"invalid": False, "correct": False}}

    def observe(self, agent: str) -> str:
        self._check(agent)
        lines = ["S" + super().observe("chooser")[1:]]  # role letter S, then the same numbered rows
        for label in self.open_labels():
            lines.append(SudokuEnv.observe(self.selecting(label), "placer").rsplit("\n", 1)[1])
        return "\n".join(lines)

    def step(self, agent: str, action: str) -> None:
        self._check(agent)
        if not (isinstance(action, str) and len(action) == 2 and action[0] in LABELS and action[1] in DIGITS):
            raise ValueError(f"sudoku_solo: the action is a cell letter then a digit, like 'B3', got {action!r}")
        super().step("chooser", action[0])
        if self.selected is not None:
            super().step("placer", action[1])
        invalid = self.infos.pop("chooser")["invalid"]
        correct = self.infos.pop("placer", {"correct": False})["correct"]
        self.infos = {"solo": {"invalid": invalid, "correct": correct}}

    def open_labels(self) -> list[str]:
        """Letters of the cells still empty, in reading order."""
        return [label for label, (r, c) in self.cells.items() if not self.grid[r][c]]

    def selecting(self, label: str) -> SudokuSoloEnv:
        """A copy with the cell `label` selected: the state between the two halves of an action, where
        the team's placer would act (used for the observation and by the node's reward)."""
        view = self.clone()
        view.selected = self.cells[label]
        return view

    @classmethod
    def reference_policies(cls) -> dict[str, Any]:
        """The team's random, always_A<d>, fewest_candidates and optimal (`SudokuEnv.reference_policies`), each
        as one "B3" action."""
        return dict(REFERENCE_POLICIES)

    def action_examples(self, agent: str) -> list[str]:
        self._check(agent)
        if self.done:
            return []
        return [label + str(digit) for label in self.open_labels() for digit in range(1, self.size + 1)]

    @staticmethod
    def _check(agent: str) -> None:
        if agent != "solo":
            raise ValueError(f"sudoku_solo: unknown agent {agent!r}: the only agent is 'solo'")


# -- reference policies (`SudokuSoloEnv.reference_policies`) --------------------------------------


def _random(env: Any, agent: str, rng: random.Random) -> str:
    check_solo(agent)
    return rng.choice(open_cells(env)) + str(rng.randint(1, env.size))


def _fewest_candidates(env: Any, agent: str, rng: random.Random) -> str:
    check_solo(agent)
    label = fewest_candidates_cell(env)
    return label + candidate_digit(env, env.cells[label], rng)


def _optimal(env: Any, agent: str, rng: random.Random) -> str:
    check_solo(agent)
    label = fewest_candidates_cell(env)
    r, c = env.cells[label]
    return label + str(env.solution[r][c])


REFERENCE_POLICIES: dict[str, ReferencePolicy] = {
    "random": _random,
    **{f"always_A{d}": solo_always(f"A{d}") for d in range(1, 5)},
    "fewest_candidates": _fewest_candidates,
    "optimal": _optimal,
}
