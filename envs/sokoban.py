"""Sokoban: two agents push boxes onto targets by steering one shared warehouse keeper.

Like Plan-Path (envs/plan_path.py), the "vertical" agent moves the keeper up or down ("U", "D") and the
"horizontal" agent left or right ("L", "R"); the movers alternate, vertical first, and there is no
"stay". Walking into a box pushes it one cell if the cell beyond is free; a move into a wall, or into a
box that cannot move, is blocked: the keeper stays and `infos[agent]["blocked"]` is True. A list of
moves is a macro action (`play`): applied in order, stopping when the level is solved or deadlocked, or
at the first blocked move.

`team_reward()` is the fraction of boxes on targets (1.0 when solved, which terminates the episode).
`distance(agent)` is the fewest moves that solve the level from here when `agent` moves next and the
movers keep alternating (a blocked move counts, it is how a mover waits); a move that leaves a level
that can no longer be solved (a box pushed into a corner, ...) terminates the episode with
`infos[agent]["deadlock"]` True. Nodes use the distance as a dense local reward (nodes/sokoban.py).

Problems are procedural: `SokobanEnv.problems(split, count, sizes=[5, 6, 7], boxes=[1], density=0.1,
max_moves=None)` draws a walled room per seed, puts the boxes on their targets, and plays the game
backwards (the keeper walks and pulls boxes) from that solved state, so every level is solvable; a
breadth-first solver then checks that the alternating team solves it too and records the fewest moves
("team_moves"). Train problem i has seed i, test problem i seed 10**9 + i. A problem is a plain dict
{"seed", "rows", "cols", "walls": [[r, c], ...] (the border included), "targets", "boxes", "player",
"team_moves"}.

The observation uses only the tiny built-in tokenizer's characters (digits, A-Z, space, newline and
`. # : , = -`): the role letter, the room, and the coordinates (0-based):

    V             role: V = vertical, H = horizontal
    ######        "#" wall, "." floor, "A" the keeper, "B" a box, "T" a target,
    #..T.#        "X" a box on a target, "Y" the keeper on a target
    #.B..#
    #.A..#
    ######
    A=3,2 B=2,2 T=1,3
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from envs.reference_policies import mover_moves, movers_constant, movers_random, ties
from mas_async.api import Env, ReferencePolicy, check_split

Cell = tuple[int, int]
State = tuple[Cell, tuple[Cell, ...]]  # (keeper, sorted boxes)

TEST_SEED_OFFSET = 10**9
AGENTS = ("vertical", "horizontal")  # the order of the movers; phase i means AGENTS[i] moves next
ROLE_LETTER = {"vertical": "V", "horizontal": "H"}
MOVES: dict[str, dict[str, Cell]] = {
    "vertical": {"U": (-1, 0), "D": (1, 0)},
    "horizontal": {"L": (0, -1), "R": (0, 1)},
}
MAX_ATTEMPTS = 1000  # rooms drawn per seed before giving up
PULL_PROBABILITY = 0.8  # reverse play pulls a box whenever it can with this probability


@dataclass(frozen=True)
class Board:
    """The fixed part of a level: its size, walls (off-grid cells count as walls) and targets."""

    rows: int
    cols: int
    walls: frozenset[Cell]
    targets: frozenset[Cell]

    def blocked(self, cell: Cell) -> bool:
        return not (0 <= cell[0] < self.rows and 0 <= cell[1] < self.cols) or cell in self.walls

    def solved(self, state: State) -> bool:
        return self.targets.issuperset(state[1])


def move(board: Board, state: State, delta: Cell) -> tuple[State, bool]:
    """The state after the keeper moves by `delta`, pushing a box ahead of it; (state, blocked)."""
    (r, c), boxes = state
    ahead = (r + delta[0], c + delta[1])
    if board.blocked(ahead):
        return state, True
    if ahead in boxes:
        beyond = (ahead[0] + delta[0], ahead[1] + delta[1])
        if board.blocked(beyond) or beyond in boxes:
            return state, True
        boxes = tuple(sorted(beyond if box == ahead else box for box in boxes))
    return (ahead, boxes), False


def _successors(board: Board, node: tuple[State, int]) -> list[tuple[State, int]]:
    state, phase = node
    return [(move(board, state, delta)[0], 1 - phase) for delta in MOVES[AGENTS[phase]].values()]


def team_moves(board: Board, start: State) -> int | None:
    """Fewest alternating moves (vertical first, blocked moves included) that solve the level from
    `start`, or None when the team cannot solve it. Breadth-first over (state, whose move)."""
    seen = {(start, 0)}
    queue = deque([(start, 0, 0)])
    while queue:
        state, phase, moves = queue.popleft()
        if board.solved(state):
            return moves
        for nxt in _successors(board, (state, phase)):
            if nxt not in seen:
                seen.add(nxt)
                queue.append((*nxt, moves + 1))
    return None


@lru_cache(maxsize=64)
def team_distances(board: Board, start: State) -> dict[tuple[State, int], int]:
    """Fewest moves to solve from every (state, phase) reachable from `start` with either mover first;
    states that cannot be solved are absent. Shared by every env and clone of the same problem: callers
    must not mutate it."""
    parents: dict[tuple[State, int], list[tuple[State, int]]] = {}
    queue = deque([(start, 0), (start, 1)])
    parents.update({node: [] for node in queue})
    while queue:
        node = queue.popleft()
        for nxt in _successors(board, node):
            if nxt not in parents:
                parents[nxt] = []
                queue.append(nxt)
            parents[nxt].append(node)
    dist = {node: 0 for node in parents if board.solved(node[0])}
    queue = deque(dist)
    while queue:
        node = queue.popleft()
        for parent in parents[node]:
            if parent not in dist:
                dist[parent] = dist[node] + 1
                queue.append(parent)
    return dist


def _connected(cells: list[Cell]) -> bool:
    if not cells:
        return False
    todo, seen = [cells[0]], {cells[0]}
    free = set(cells)
    while todo:
        r, c = todo.pop()
        for nxt in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
            if nxt in free and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return len(seen) == len(free)


def _reverse_play(board: Board, keeper: Cell, rng: random.Random, steps: int) -> State:
    """Walk backwards from the solved state: the keeper steps away from a box behind it, pulling it.
    Each pull undoes a push, so the level stays solvable with free moves."""
    boxes = set(board.targets)
    for _ in range(steps):
        dr, dc = rng.choice(((-1, 0), (1, 0), (0, -1), (0, 1)))
        ahead = (keeper[0] + dr, keeper[1] + dc)
        if board.blocked(ahead) or ahead in boxes:
            continue
        behind = (keeper[0] - dr, keeper[1] - dc)
        if behind in boxes and rng.random() < PULL_PROBABILITY:
            boxes.remove(behind)
            boxes.add(keeper)
        keeper = ahead
    return keeper, tuple(sorted(boxes))


def make_problem(
    seed: int, sizes: list[int], boxes: list[int], density: float, max_moves: int | None
) -> dict[str, Any]:
    """The level of `seed`: the same seed and options always give the same dict."""
    rng = random.Random(seed)
    for _ in range(MAX_ATTEMPTS):
        rows, cols, count = rng.choice(sizes), rng.choice(sizes), rng.choice(boxes)
        border = {(r, c) for r in range(rows) for c in range(cols) if r in (0, rows - 1) or c in (0, cols - 1)}
        inner = [(r, c) for r in range(1, rows - 1) for c in range(1, cols - 1)]
        walls = border | {cell for cell in inner if rng.random() < density}
        free = [cell for cell in inner if cell not in walls]
        if len(free) < 2 * count + 2 or not _connected(free):
            continue
        targets = rng.sample(free, count)
        board = Board(rows, cols, frozenset(walls), frozenset(targets))
        keeper = rng.choice([cell for cell in free if cell not in board.targets])
        start = _reverse_play(board, keeper, rng, rng.randint(10, 40))
        if board.solved(start):
            continue
        moves = team_moves(board, start)
        if moves is None or moves < 2 or (max_moves is not None and moves > max_moves):
            continue
        return {
            "seed": seed,
            "rows": rows,
            "cols": cols,
            "walls": [list(cell) for cell in sorted(walls)],
            "targets": [list(cell) for cell in sorted(targets)],
            "boxes": [list(cell) for cell in start[1]],
            "player": list(start[0]),
            "team_moves": moves,
        }
    raise ValueError(
        f"sokoban: no level for seed {seed} in {MAX_ATTEMPTS} attempts (sizes={sizes}, boxes={boxes}, "
        f"density={density}, max_moves={max_moves}); lower the density or raise max_moves"
    )


class SokobanEnv(Env):
    """Two movers, one keeper, boxes to push onto targets: see the module docstring."""

    actions = {
        "vertical": 'a move, "U" or "D": the keeper walks (or pushes a box) one cell; blocked by a wall or a box '
        "that cannot move; a list of moves is a macro action (`play`)",
        "horizontal": 'a move, "L" or "R": the keeper walks (or pushes a box) one cell; blocked by a wall or a box '
        "that cannot move; a list of moves is a macro action (`play`)",
    }
    rewards = (
        "team_reward() is the fraction of boxes on targets; the episode ends when every box is on one (1.0) or "
        "a move leaves the level unsolvable (deadlock)"
    )
    info_keys = {
        agent: {
            "blocked": "the move hit a wall or a box that cannot move",
            "deadlock": "the move left the level unsolvable (the episode ends)",
            "moves": "a macro action: the moves applied",
        }
        for agent in ("vertical", "horizontal")
    }

    possible_agents = list(AGENTS)

    def __init__(self) -> None:
        self.problem: dict[str, Any] | None = None
        self.terminations = {}
        self.truncations = {}
        self.infos = {}

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """Start on `options["problem"]`, or on the train level of `seed` when no problem is given."""
        problem = (options or {}).get("problem")
        if problem is None:
            if seed is None:
                raise ValueError("sokoban: reset needs options={'problem': dict} or a seed")
            problem = make_problem(seed, [5, 6, 7], [1], 0.1, None)
        self.problem = problem
        self.board, self.start = _parse_problem(problem)
        self.state = self.start
        self.distances: dict[tuple[State, int], int] | None = None  # computed on first use, shared by clones
        done = self.board.solved(self.state)
        self.terminations = {agent: done for agent in self.possible_agents}
        self.truncations = {agent: False for agent in self.possible_agents}
        self.infos = {agent: {"blocked": False, "deadlock": False} for agent in self.possible_agents}

    def observe(self, agent: str) -> str:
        """Role letter, the room, then "A=r,c B=r,c ... T=r,c ..." (see the module docstring)."""
        _check_agent(agent)
        keeper, boxes = self.state
        board, lines = self.board, [ROLE_LETTER[agent]]
        for r in range(board.rows):
            row = []
            for c in range(board.cols):
                cell, target = (r, c), (r, c) in board.targets
                if cell == keeper:
                    row.append("Y" if target else "A")
                elif cell in boxes:
                    row.append("X" if target else "B")
                else:
                    row.append("#" if cell in board.walls else "T" if target else ".")
            lines.append("".join(row))
        coords = [f"A={keeper[0]},{keeper[1]}"]
        coords += [f"B={r},{c}" for r, c in boxes] + [f"T={r},{c}" for r, c in sorted(board.targets)]
        lines.append(" ".join(coords))
        return "\n".join(lines)

    def step(self, agent: str, action: str | list[str]) -> None:
        """Move the keeper by `agent`'s action, pushing a box if it can; blocked moves leave it. A list
        of moves is a macro action (`play`)."""
        if isinstance(action, list | tuple):
            self.play(agent, list(action))
            return
        _check_agent(agent)
        if action not in MOVES[agent]:
            raise ValueError(f"sokoban: agent {agent!r} cannot play {action!r}: allowed are {', '.join(MOVES[agent])}")
        if self.done:
            raise ValueError("sokoban: the episode is over (solved or deadlocked); reset first")
        self._move(agent, action)

    def _move(self, agent: str, action: str) -> None:
        # One checked move; `play` calls it directly so that a subclass's `step` is not re-entered.
        self.state, blocked = move(self.board, self.state, MOVES[agent][action])
        other = AGENTS[1 - AGENTS.index(agent)]
        solved = self.board.solved(self.state)
        deadlock = not solved and self.distance(other) is None
        self.infos[agent] = {"blocked": blocked, "deadlock": deadlock}
        if solved or deadlock:
            self.terminations = {a: True for a in self.possible_agents}

    def play(self, agent: str, moves: list[str]) -> None:
        """A macro action: `agent`'s moves applied in order, stopping when the level is solved or
        deadlocked, or at the first blocked move (a bump or an immovable box: the keeper stays).
        `infos[agent]` gains "moves", the number applied before the stop. Every move is checked first,
        so an unknown letter raises ValueError without changing anything."""
        _check_agent(agent)
        bad = [move for move in moves if not isinstance(move, str) or move not in MOVES[agent]]
        if bad:
            raise ValueError(f"sokoban: agent {agent!r} cannot play {bad[0]!r}: allowed are {', '.join(MOVES[agent])}")
        if self.done:
            raise ValueError("sokoban: the episode is over (solved or deadlocked); reset first")
        applied = 0
        info = {"blocked": False, "deadlock": False}
        for move_letter in moves:
            if self.done:
                break
            self._move(agent, move_letter)
            info = dict(self.infos[agent])
            if info["blocked"]:
                break
            applied += 1
        self.infos[agent] = {**info, "moves": applied}

    def team_reward(self) -> float:
        """The fraction of boxes on targets."""
        boxes = self.state[1]
        return sum(box in self.board.targets for box in boxes) / len(boxes)

    def distance(self, agent: str) -> int | None:
        """Fewest alternating moves that solve the level when `agent` moves next; None if it cannot be."""
        _check_agent(agent)
        if self.distances is None:
            self.distances = team_distances(self.board, self.start)
        return self.distances.get((self.state, AGENTS.index(agent)))

    def move_quality(self, agent: str, action: Any, after: SokobanEnv) -> bool | None:
        """A good move leaves fewer team moves to the solution (`eval/progress_rate/<agent>`)."""
        before, left = self.distance(agent), after.distance(AGENTS[1 - AGENTS.index(agent)])
        return before is not None and left is not None and left < before

    @classmethod
    def reference_policies(cls) -> dict[str, Any]:
        """random, always_<V>_<H> (each constant team answer) and optimal (the move after which the fewest
        alternating team moves are left: the team's breadth-first solver, `team_distances`)."""
        return dict(REFERENCE_POLICIES)

    def action_examples(self, agent: str) -> list[str]:
        """Every action `agent` may play (blocked moves are legal): used by envs.check.check_env."""
        _check_agent(agent)
        return [] if self.done else list(MOVES[agent])

    def clone(self) -> SokobanEnv:
        # The problem, board, start and distances are never mutated and the state is a tuple: clones
        # share them.
        return self.shallow_clone()

    @classmethod
    def problems(
        cls,
        split: str,
        count: int,
        sizes: list[int] | None = None,
        boxes: int | list[int] = 1,
        density: float = 0.1,
        max_moves: int | None = None,
        first: int = 0,
    ) -> list[dict[str, Any]]:
        """Levels `first .. first + count - 1` of `split`; train seed i is i, test seed i is 10**9 + i."""
        check_split(split, count)
        sizes = [5, 6, 7] if sizes is None else list(sizes)
        boxes = [boxes] if isinstance(boxes, int) else list(boxes)
        if not sizes or any(not isinstance(s, int) or not 4 <= s <= 10 for s in sizes):
            raise ValueError(f"sokoban: sizes must be a non-empty list of integers in [4, 10], got {sizes!r}")
        if not boxes or any(not isinstance(b, int) or not 1 <= b <= 3 for b in boxes):
            raise ValueError(f"sokoban: boxes must be an integer or a list of integers in [1, 3], got {boxes!r}")
        if not 0.0 <= density < 0.5:
            raise ValueError(f"sokoban: density must be in [0, 0.5), got {density!r}")
        if max_moves is not None and (not isinstance(max_moves, int) or max_moves < 2):
            raise ValueError(f"sokoban: max_moves must be an integer >= 2 or None, got {max_moves!r}")
        if first < 0 or first + count > TEST_SEED_OFFSET:
            raise ValueError(f"sokoban: problem indices must lie in [0, {TEST_SEED_OFFSET}), got first={first}")
        offset = 0 if split == "train" else TEST_SEED_OFFSET
        return [make_problem(offset + i, sizes, boxes, density, max_moves) for i in range(first, first + count)]


def _check_agent(agent: str) -> None:
    if agent not in MOVES:
        raise ValueError(f"sokoban: unknown agent {agent!r}: agents are {', '.join(AGENTS)}")


def _parse_problem(problem: dict[str, Any]) -> tuple[Board, State]:
    missing = [key for key in ("rows", "cols", "walls", "targets", "boxes", "player") if key not in problem]
    if missing:
        raise ValueError(f"sokoban: problem dict lacks {', '.join(missing)}")
    rows, cols = int(problem["rows"]), int(problem["cols"])
    walls = frozenset((int(r), int(c)) for r, c in problem["walls"])
    targets = frozenset((int(r), int(c)) for r, c in problem["targets"])
    boxes = tuple(sorted((int(r), int(c)) for r, c in problem["boxes"]))
    keeper = (int(problem["player"][0]), int(problem["player"][1]))
    board = Board(rows, cols, walls, targets)
    if not boxes or len(set(boxes)) != len(boxes) or len(boxes) != len(targets):
        raise ValueError(f"sokoban: problem {problem.get('seed')!r} needs as many distinct boxes as targets")
    for name, cells in (("player", [keeper]), ("box", boxes), ("target", targets)):
        for cell in cells:
            if board.blocked(cell):
                raise ValueError(f"sokoban: {name} {list(cell)} is off the {rows}x{cols} room or on a wall")
    if keeper in boxes:
        raise ValueError(f"sokoban: the player {list(keeper)} stands on a box")
    return board, (keeper, boxes)


# -- reference policies (`SokobanEnv.reference_policies`) -----------------------------------------


def _optimal(env: Any, agent: str, rng: random.Random) -> str:
    left = team_distances(env.board, env.start)
    partner = 1 - AGENTS.index(agent)

    def after(m: str) -> float:
        state, _ = move(env.board, env.state, MOVES[agent][m])
        return left.get((state, partner), math.inf)

    return ties(mover_moves(MOVES, agent), after, rng)


REFERENCE_POLICIES: dict[str, ReferencePolicy] = {
    "random": movers_random(MOVES),
    **{f"always_{v}_{h}": movers_constant(MOVES, v, h) for v in "UD" for h in "LR"},
    "optimal": _optimal,
}
