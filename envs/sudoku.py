"""Sudoku: a "chooser" picks an empty cell and a "placer" writes a digit into it.

Puzzles are 4x4 (2x2 boxes, digits 1-4) or 9x9 (3x3 boxes, digits 1-9), each with exactly one solution.
Every empty cell of a puzzle is labelled with a letter, A, B, C, ... in reading order, for the whole
episode, so both answers are one character: a turn is the chooser naming a cell by its letter ("B"),
then the placer naming a digit for it ("4"). A digit is written only when it is the solution's digit
("checked mode": the board never holds a wrong digit, so it is always solvable); either way the
selection is cleared and the next turn starts with the chooser. A chooser naming a filled cell or a
letter that labels no cell, or a placer without a selected cell, changes nothing; `infos[agent]` says
what happened ({"invalid": bool} for the chooser, {"correct": bool} for the placer). A complete grid
is a macro action (`fill_grid`, played by the tool + plan team of `envs/tool_plan.py`): written at once
if it is the solution, else nothing changes. `team_reward()` is
1.0 once the grid is full (which terminates the episode), else 0.0; `candidates(cell)` (the digits not
yet in the cell's row, column and box) gives nodes a dense local reward (nodes/sudoku.py).

Problems are procedural: `SudokuEnv.problems(split, count, sizes=[4], holes=6)` shuffles a solved grid
per seed (digits, rows within bands, bands, columns within stacks, stacks), then empties cells in a
seeded order, keeping only removals after which a solver still finds exactly one solution, until
`holes` cells (at most 26, one letter each) are empty. Train problem i has seed i, test problem i seed
10**9 + i. A problem is a plain dict {"seed", "size", "puzzle": ["12.4", ...] ("." empty),
"solution": ["1234", ...], "holes"}.

The observation uses only the tiny built-in tokenizer's characters: the role letter, the numbered rows
(an open cell shows its letter), and for the placer the selected cell with its row, column and box:

    P
    1:AB34
    2:C412
    3:2143
    4:4321
    AT=B ROW=AB34 COL=B413 BOX=ABC4
"""

from __future__ import annotations

import random
from typing import Any

from mas_async.api import Env, ReferencePolicy, check_split

Cell = tuple[int, int]

TEST_SEED_OFFSET = 10**9
AGENTS = ("chooser", "placer")
ROLE_LETTER = {"chooser": "C", "placer": "P"}
BOX = {4: 2, 9: 3}  # grid size -> box size
LABELS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # of the empty cells, in reading order
MAX_ATTEMPTS = 20  # solved grids drawn per seed before giving up on `holes`


def count_solutions(grid: list[list[int]], limit: int = 2) -> int:
    """Number of solutions of `grid` (0 = empty cell), counting no further than `limit`. Backtracking
    on the empty cell with the fewest candidates; `grid` is restored before returning."""
    n = len(grid)
    empty = [(r, c) for r in range(n) for c in range(n) if grid[r][c] == 0]
    if not empty:
        return 1
    best, best_options = None, None
    for r, c in empty:
        options = _options(grid, r, c)
        if best_options is None or len(options) < len(best_options):
            best, best_options = (r, c), options
            if len(options) <= 1:
                break
    assert best is not None and best_options is not None
    found = 0
    r, c = best
    for digit in best_options:
        grid[r][c] = digit
        found += count_solutions(grid, limit - found)
        if found >= limit:
            break
    grid[r][c] = 0
    return found


def _options(grid: list[list[int]], r: int, c: int) -> list[int]:
    n = len(grid)
    b = BOX[n]
    used = set(grid[r]) | {grid[i][c] for i in range(n)}
    top, left = r - r % b, c - c % b
    used |= {grid[i][j] for i in range(top, top + b) for j in range(left, left + b)}
    return [d for d in range(1, n + 1) if d not in used]


def solved_grid(n: int, rng: random.Random) -> list[list[int]]:
    """A random valid full grid: the standard pattern with shuffled digits, rows, bands, columns, stacks."""
    b = BOX[n]

    def order() -> list[int]:
        bands = rng.sample(range(b), b)
        return [band * b + i for band in bands for i in rng.sample(range(b), b)]

    rows, cols, digits = order(), order(), rng.sample(range(1, n + 1), n)
    return [[digits[(b * (r % b) + r // b + c) % n] for c in cols] for r in rows]


def make_problem(seed: int, sizes: list[int], holes: int) -> dict[str, Any]:
    """The puzzle of `seed`: the same seed and options always give the same dict."""
    rng = random.Random(seed)
    most = 0
    for _ in range(MAX_ATTEMPTS):
        n = rng.choice(sizes)
        solution = solved_grid(n, rng)
        grid = [row[:] for row in solution]
        cells = [(r, c) for r in range(n) for c in range(n)]
        rng.shuffle(cells)
        emptied = 0
        for r, c in cells:
            if emptied == holes:
                break
            grid[r][c] = 0
            if count_solutions(grid) == 1:
                emptied += 1
            else:
                grid[r][c] = solution[r][c]
        if emptied == holes:
            return {
                "seed": seed,
                "size": n,
                "puzzle": ["".join(str(d) if d else "." for d in row) for row in grid],
                "solution": ["".join(str(d) for d in row) for row in solution],
                "holes": holes,
            }
        most = max(most, emptied)
    raise ValueError(
        f"sudoku: seed {seed} (sizes={sizes}) allows at most {most} empty cells with a unique solution in "
        f"{MAX_ATTEMPTS} attempts, asked holes={holes}; lower holes"
    )


class SudokuEnv(Env):
    """A chooser and a placer fill a Sudoku together: see the module docstring."""

    actions = {
        "chooser": 'a letter, "A", "B", ...: the open cell it names is selected for the placer',
        "placer": 'a digit, "1".."4" (or "1".."9"): written into the selected cell if it is the solution\'s digit',
    }
    rewards = "team_reward() is 1.0 once the grid is full (the episode ends), else 0.0"
    info_keys = {
        "chooser": {"invalid": "the letter named no open cell (nothing selected)"},
        "placer": {"correct": "the digit was the solution's and was written"},
    }

    possible_agents = list(AGENTS)

    def __init__(self) -> None:
        self.problem: dict[str, Any] | None = None
        self.terminations = {}
        self.truncations = {}
        self.infos = {}

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """Start on `options["problem"]`, or on the train puzzle of `seed` when no problem is given."""
        problem = (options or {}).get("problem")
        if problem is None:
            if seed is None:
                raise ValueError("sudoku: reset needs options={'problem': dict} or a seed")
            problem = make_problem(seed, [4], 6)
        self.problem = problem
        self.size, self.grid, self.solution = _parse_problem(problem)
        holes = [(r, c) for r in range(self.size) for c in range(self.size) if not self.grid[r][c]]
        self.cells: dict[str, Cell] = dict(zip(LABELS, holes, strict=False))  # never mutated
        self.selected: Cell | None = None
        done = self.filled()
        self.terminations = {agent: done for agent in self.possible_agents}
        self.truncations = {agent: False for agent in self.possible_agents}
        self.infos = {"chooser": {"invalid": False}, "placer": {"correct": False}}

    def observe(self, agent: str) -> str:
        """Role letter, numbered rows, and for the placer "AT=label ROW=... COL=... BOX=..."."""
        _check_agent(agent)
        n, b = self.size, BOX[self.size]
        shown = [[str(d) if d else "." for d in row] for row in self.grid]
        for label, (r, c) in self.cells.items():
            if not self.grid[r][c]:
                shown[r][c] = label
        lines = [ROLE_LETTER[agent]] + [f"{r + 1}:" + "".join(shown[r]) for r in range(n)]
        if agent == "placer" and self.selected is not None:
            r, c = self.selected
            top, left = r - r % b, c - c % b
            box = "".join(shown[i][j] for i in range(top, top + b) for j in range(left, left + b))
            column = "".join(shown[i][c] for i in range(n))
            lines.append(f"AT={shown[r][c]} ROW={''.join(shown[r])} COL={column} BOX={box}")
        return "\n".join(lines)

    def step(self, agent: str, action: str) -> None:
        """The chooser selects the cell labelled `action`; the placer writes digit `action` there if it
        is the solution's."""
        _check_agent(agent)
        if self.done:
            raise ValueError("sudoku: the episode is over (the grid is full); reset first")
        if agent == "chooser":
            if not (isinstance(action, str) and len(action) == 1 and action in LABELS):
                raise ValueError(f"sudoku: the chooser plays one cell letter like 'B', got {action!r}")
            cell = self.cells.get(action)
            valid = cell is not None and not self.grid[cell[0]][cell[1]]
            self.selected = cell if valid else None
            self.infos["chooser"] = {"invalid": not valid}
            return
        if not (isinstance(action, str) and len(action) == 1 and action.isdigit()):
            raise ValueError(f"sudoku: the placer plays one digit like '4', got {action!r}")
        cell, self.selected = self.selected, None
        correct = cell is not None and int(action) == self.solution[cell[0]][cell[1]]
        if correct:
            self.grid[cell[0]][cell[1]] = int(action)
        self.infos["placer"] = {"correct": correct}
        if self.filled():
            self.terminations = {a: True for a in self.possible_agents}

    def fill_grid(self, grid: list[list[int]]) -> bool:
        """A macro action: a complete grid, written at once if it is the solution (checked mode: the board
        never holds a wrong digit, so any other grid, of any shape, changes nothing). Returns whether it
        was written; the episode then terminates. Raises ValueError (changing nothing) when `grid` is not a
        list of lists of integers, or the episode is over."""
        if not isinstance(grid, list | tuple) or not all(
            isinstance(row, list | tuple) and all(isinstance(d, int) and not isinstance(d, bool) for d in row)
            for row in grid
        ):
            raise ValueError(f"sudoku: a grid is a list of rows of integers, got {grid!r:.80}")
        if self.done:
            raise ValueError("sudoku: the episode is over (the grid is full); reset first")
        correct = [list(row) for row in grid] == self.solution
        if correct:
            self.grid = [row[:] for row in self.solution]
            self.selected = None
            self.terminations = {a: True for a in self.possible_agents}
        return correct

    def filled(self) -> bool:
        return all(all(row) for row in self.grid)

    def team_reward(self) -> float:
        return 1.0 if self.filled() else 0.0

    def candidates(self, cell: Cell) -> list[int]:
        """Digits not yet in the row, column or box of the empty `cell`; [] for a filled or off-board cell."""
        r, c = cell
        if not (0 <= r < self.size and 0 <= c < self.size) or self.grid[r][c]:
            return []
        return _options(self.grid, r, c)

    @classmethod
    def reference_policies(cls) -> dict[str, Any]:
        """random (an open cell, any digit), always_A_<d> (cell A, digit d), fewest_candidates (the simplest
        solver: the most constrained open cell, then one of its candidate digits, the forced one when there is
        one) and optimal (that cell, its solution digit)."""
        return dict(REFERENCE_POLICIES)

    def action_examples(self, agent: str) -> list[str]:
        """Valid actions of `agent` now (used by envs.check.check_env): the empty cells for the chooser,
        the digits for the placer once a cell is selected."""
        _check_agent(agent)
        if self.done:
            return []
        if agent == "chooser":
            return [label for label, (r, c) in self.cells.items() if not self.grid[r][c]]
        return [] if self.selected is None else [str(d) for d in range(1, self.size + 1)]

    def clone(self) -> SudokuEnv:
        # The problem and solution are never mutated; the grid is, so it is copied.
        other = self.shallow_clone()
        other.grid = [row[:] for row in self.grid]
        return other

    @classmethod
    def problems(
        cls, split: str, count: int, sizes: list[int] | None = None, holes: int = 6, first: int = 0
    ) -> list[dict[str, Any]]:
        """Puzzles `first .. first + count - 1` of `split`; train seed i is i, test seed i is 10**9 + i."""
        check_split(split, count)
        sizes = [4] if sizes is None else list(sizes)
        if not sizes or any(s not in BOX for s in sizes):
            raise ValueError(f"sudoku: sizes must be a non-empty list of 4 and/or 9, got {sizes!r}")
        most = min(min(sizes) ** 2 - 1, len(LABELS))
        if not isinstance(holes, int) or not 1 <= holes <= most:
            raise ValueError(
                f"sudoku: holes must be an integer in [1, {most}] (one letter per empty cell), got {holes!r}"
            )
        if first < 0 or first + count > TEST_SEED_OFFSET:
            raise ValueError(f"sudoku: problem indices must lie in [0, {TEST_SEED_OFFSET}), got first={first}")
        offset = 0 if split == "train" else TEST_SEED_OFFSET
        return [make_problem(offset + i, sizes, holes) for i in range(first, first + count)]


def _check_agent(agent: str) -> None:
    if agent not in ROLE_LETTER:
        raise ValueError(f"sudoku: unknown agent {agent!r}: agents are {', '.join(AGENTS)}")


def _parse_problem(problem: dict[str, Any]) -> tuple[int, list[list[int]], list[list[int]]]:
    missing = [key for key in ("size", "puzzle", "solution") if key not in problem]
    if missing:
        raise ValueError(f"sudoku: problem dict lacks {', '.join(missing)}")
    n = int(problem["size"])
    if n not in BOX:
        raise ValueError(f"sudoku: size must be 4 or 9, got {n}")
    grids = []
    for name, empty in (("puzzle", "."), ("solution", "")):
        rows = problem[name]
        digits = "123456789"[:n] + empty
        if len(rows) != n or any(len(row) != n or any(ch not in digits for ch in row) for row in rows):
            raise ValueError(f"sudoku: {name} must be {n} rows of {n} characters from {digits!r}")
        grids.append([[0 if ch == "." else int(ch) for ch in row] for row in rows])
    puzzle, solution = grids
    if any(puzzle[r][c] not in (0, solution[r][c]) for r in range(n) for c in range(n)):
        raise ValueError(f"sudoku: problem {problem.get('seed')!r}: the puzzle's clues disagree with its solution")
    return n, puzzle, solution


# -- reference policies (`SudokuEnv.reference_policies`; `SudokuSoloEnv`'s play the same as one action) -


def open_cells(env: Any) -> list[str]:
    """Letters of the cells still empty, in reading order."""
    return [label for label, (r, c) in env.cells.items() if not env.grid[r][c]]


def fewest_candidates_cell(env: Any) -> str:
    """The open cell with the fewest candidate digits (the first in reading order on a tie)."""
    return min(open_cells(env), key=lambda label: len(env.candidates(env.cells[label])))


def candidate_digit(env: Any, cell: Cell, rng: random.Random) -> str:
    """One of the cell's candidate digits, at random: a fixed choice would repeat a wrong digit forever (it is
    never written)."""
    return str(rng.choice(env.candidates(cell) or list(range(1, env.size + 1))))


def _role(agent: str) -> str:
    if agent not in AGENTS:
        raise ValueError(f"sudoku: a team's reference policy plays chooser or placer, not {agent!r}")
    return agent


def _random(env: Any, agent: str, rng: random.Random) -> str:
    if _role(agent) == "chooser":
        return rng.choice(open_cells(env))
    return str(rng.randint(1, env.size))


def _constant(label: str, digit: int) -> ReferencePolicy:
    def always(env: Any, agent: str, rng: random.Random) -> str:
        return label if _role(agent) == "chooser" else str(digit)

    return always


def _fewest_candidates(env: Any, agent: str, rng: random.Random) -> str:
    if _role(agent) == "chooser":
        return fewest_candidates_cell(env)
    return candidate_digit(env, env.selected, rng)


def _optimal(env: Any, agent: str, rng: random.Random) -> str:
    if _role(agent) == "chooser":
        return fewest_candidates_cell(env)
    r, c = env.selected
    return str(env.solution[r][c])


REFERENCE_POLICIES: dict[str, ReferencePolicy] = {
    "random": _random,
    **{f"always_A_{d}": _constant("A", d) for d in range(1, 5)},
    "fewest_candidates": _fewest_candidates,
    "optimal": _optimal,
}
