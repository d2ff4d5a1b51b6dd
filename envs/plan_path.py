"""Plan-Path: two agents steer one shared token through a grid to a goal.

The "vertical" agent moves the token up or down ("U", "D") and the "horizontal" agent left or right
("L", "R"); either may stay ("S"), though the shipped workflow's movers must move (nodes/plan_path.py).
Neither can solve a problem alone: generated problems put the start and the goal in different rows and
different columns. A list of moves is a macro action (`play`): applied in order, stopping at the goal or
at the first blocked move (the tool + plan team of `envs/tool_plan.py` plays whole paths that way). A move into a wall or off the grid leaves the
token where it was and is recorded as blocked in `infos[agent]["blocked"]`. The episode terminates when
the token reaches the goal; `team_reward()` is then 1.0 (0.0 before), and `distance()` (the BFS
shortest-path length to the goal) gives nodes a dense local reward.

Problems are procedural: `PlanPathEnv.problems(split, count, sizes=[4, 5], density=0.2)` derives problem
i of "train" from seed i and problem i of "test" from seed 10**9 + i, so the splits never overlap. A
problem is a plain dict {"seed", "rows", "cols", "walls": [[r, c], ...], "start": [r, c],
"goal": [r, c], "shortest": int, "team_moves": int}; every generated start reaches its goal in at least
2 moves, and the team reaches it too when it must alternate a vertical and a horizontal move without
staying (`team_moves`, the fewest such moves).

The observation is a short string using only the characters of the tiny built-in character-level model
(digits, A-Z, space, newline and `. # : , = -`):

    V          role: V = vertical, H = horizontal
    .#..       the grid: "." free, "#" wall, "A" the token, "G" the goal
    A..#
    ..#G
    A=1,0 G=2,3
"""

from __future__ import annotations

import math
import random
from collections import deque
from functools import lru_cache
from typing import Any

from envs.reference_policies import mover_moves, movers_constant, movers_random, ties
from mas_async.api import Env, ReferencePolicy, check_split

Cell = tuple[int, int]

TEST_SEED_OFFSET = 10**9
ROLE_LETTER = {"vertical": "V", "horizontal": "H"}
MOVES: dict[str, dict[str, Cell]] = {
    "vertical": {"U": (-1, 0), "D": (1, 0), "S": (0, 0)},
    "horizontal": {"L": (0, -1), "R": (0, 1), "S": (0, 0)},
}
MAX_ATTEMPTS = 1000  # grids drawn per seed before giving up (only a very high density gets there)


def bfs_distances(rows: int, cols: int, walls: frozenset[Cell], goal: Cell) -> dict[Cell, int]:
    """Shortest-path length (4-neighbour moves) from every cell that can reach `goal` to `goal`."""
    dist = {goal: 0}
    queue = deque([goal])
    while queue:
        r, c = queue.popleft()
        for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < rows and 0 <= nxt[1] < cols and nxt not in walls and nxt not in dist:
                dist[nxt] = dist[(r, c)] + 1
                queue.append(nxt)
    return dist


@lru_cache(maxsize=4096)
def _distance_map(rows: int, cols: int, walls: frozenset[Cell], goal: Cell) -> dict[Cell, int]:
    # Shared by every reset and clone of the same problem; callers must not mutate it.
    return bfs_distances(rows, cols, walls, goal)


def shortest_path_length(rows: int, cols: int, walls: frozenset[Cell], start: Cell, goal: Cell) -> int | None:
    """BFS shortest-path length from `start` to `goal`, or None when the goal cannot be reached."""
    return bfs_distances(rows, cols, walls, goal).get(start)


def team_moves(rows: int, cols: int, walls: frozenset[Cell], start: Cell, goal: Cell, first: int = 0) -> int | None:
    """Fewest moves from `start` to `goal` when a vertical move (U/D) and a horizontal move (L/R)
    alternate, vertical first (`first` 1: horizontal first), and nobody may stay (a blocked move leaves
    the token in place); None when the goal cannot be reached that way. BFS over (cell, whose move)."""
    axes = (((-1, 0), (1, 0)), ((0, -1), (0, 1)))
    seen = {(start, first)}
    queue = deque([(start, first, 0)])
    while queue:
        cell, phase, moves = queue.popleft()
        if cell == goal:
            return moves
        for dr, dc in axes[phase]:
            nxt = (cell[0] + dr, cell[1] + dc)
            if not (0 <= nxt[0] < rows and 0 <= nxt[1] < cols) or nxt in walls:
                nxt = cell
            if (nxt, 1 - phase) not in seen:
                seen.add((nxt, 1 - phase))
                queue.append((nxt, 1 - phase, moves + 1))
    return None


def make_problem(seed: int, sizes: list[int], density: float) -> dict[str, Any]:
    """The problem of `seed`: the same seed, sizes and density always give the same dict."""
    rng = random.Random(seed)
    for _ in range(MAX_ATTEMPTS):
        rows, cols = rng.choice(sizes), rng.choice(sizes)
        cells = [(r, c) for r in range(rows) for c in range(cols)]
        walls = frozenset(cell for cell in cells if rng.random() < density)
        free = [cell for cell in cells if cell not in walls]
        if len(free) < 2:
            continue
        start, goal = rng.sample(free, 2)
        if start[0] == goal[0] or start[1] == goal[1]:
            continue  # both agents must move the token for the team to succeed
        shortest = shortest_path_length(rows, cols, walls, start, goal)
        if shortest is None or shortest < 2:
            continue
        team = team_moves(rows, cols, walls, start, goal)
        if team is None:
            continue
        return {
            "seed": seed,
            "rows": rows,
            "cols": cols,
            "walls": [list(cell) for cell in sorted(walls)],
            "start": list(start),
            "goal": list(goal),
            "shortest": shortest,
            "team_moves": team,
        }
    raise ValueError(
        f"plan_path: no solvable grid for seed {seed} in {MAX_ATTEMPTS} attempts "
        f"(sizes={sizes}, density={density}); lower the density"
    )


class PlanPathEnv(Env):
    """Two agents, one token, one grid: see the module docstring for the rules and observation."""

    actions = {
        "vertical": 'a move, "U" or "D": the token goes up or down one cell (into a wall or off the grid: it stays, '
        "blocked); a list of moves is a macro action (`play`)",
        "horizontal": 'a move, "L" or "R": the token goes left or right one cell (into a wall or off the grid: it '
        "stays, blocked); a list of moves is a macro action (`play`)",
    }
    rewards = "team_reward() is 1.0 once the token is on the goal (the episode ends), else 0.0"
    info_keys = {
        agent: {"blocked": "the move hit a wall or the edge", "moves": "a macro action: the moves applied"}
        for agent in ("vertical", "horizontal")
    }

    possible_agents = ["vertical", "horizontal"]

    def __init__(self) -> None:
        self.problem: dict[str, Any] | None = None
        self.terminations = {}
        self.truncations = {}
        self.infos = {}

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """Start on `options["problem"]`, or on the train problem of `seed` when no problem is given."""
        problem = (options or {}).get("problem")
        if problem is None:
            if seed is None:
                raise ValueError("plan_path: reset needs options={'problem': dict} or a seed")
            problem = make_problem(seed, [4, 5], 0.2)
        self.problem = problem
        self.rows, self.cols, self.walls, self.goal, self.position = _parse_problem(problem)
        self.dist = _distance_map(self.rows, self.cols, self.walls, self.goal)
        if self.position not in self.dist:
            raise ValueError(f"plan_path: problem {problem.get('seed')!r} has a start that cannot reach its goal")
        done = self.position == self.goal
        self.terminations = {agent: done for agent in self.possible_agents}
        self.truncations = {agent: False for agent in self.possible_agents}
        self.infos = {agent: {"blocked": False} for agent in self.possible_agents}

    def observe(self, agent: str) -> str:
        """Role letter, the grid rows, then "A=r,c G=r,c" (see the module docstring)."""
        if agent not in ROLE_LETTER:
            raise ValueError(f"plan_path: unknown agent {agent!r}: agents are {', '.join(self.possible_agents)}")
        lines = [ROLE_LETTER[agent]]
        for r in range(self.rows):
            row = []
            for c in range(self.cols):
                cell = (r, c)
                if cell == self.position:
                    row.append("A")
                elif cell == self.goal:
                    row.append("G")
                else:
                    row.append("#" if cell in self.walls else ".")
            lines.append("".join(row))
        (ar, ac), (gr, gc) = self.position, self.goal
        lines.append(f"A={ar},{ac} G={gr},{gc}")
        return "\n".join(lines)

    def moves_of(self, agent: str) -> dict[str, Cell]:
        """The moves `agent` may play, by letter (a subclass with other agents overrides this)."""
        moves = MOVES.get(agent)
        if moves is None:
            raise ValueError(f"plan_path: unknown agent {agent!r}: agents are {', '.join(self.possible_agents)}")
        return moves

    def step(self, agent: str, action: str | list[str]) -> None:
        """Move the token by `agent`'s action; a move into a wall or off the grid is blocked. A list of
        moves is a macro action (`play`)."""
        if isinstance(action, list | tuple):
            self.play(agent, list(action))
            return
        moves = self.moves_of(agent)
        if action not in moves:
            raise ValueError(f"plan_path: agent {agent!r} cannot play {action!r}: allowed are {', '.join(moves)}")
        if self.done:
            raise ValueError("plan_path: the episode is over (the token is on the goal); reset first")
        self._move(agent, moves[action])

    def _move(self, agent: str, delta: Cell) -> None:
        # One checked move; `play` calls it directly so that a subclass's `step` is not re-entered.
        dr, dc = delta
        target = (self.position[0] + dr, self.position[1] + dc)
        blocked = not (0 <= target[0] < self.rows and 0 <= target[1] < self.cols) or target in self.walls
        if not blocked:
            self.position = target
        self.infos[agent] = {"blocked": blocked}
        if self.position == self.goal:
            self.terminations = {a: True for a in self.possible_agents}

    def play(self, agent: str, moves: list[str]) -> None:
        """A macro action: `agent`'s moves applied in order, stopping at the goal or at the first blocked
        move (which leaves the token where it was). `infos[agent]` is {"blocked", "moves"}: whether a move
        was blocked, and how many moves were applied before the stop. Every move is checked first, so an
        unknown letter raises ValueError without changing anything."""
        allowed = self.moves_of(agent)
        bad = [move for move in moves if not isinstance(move, str) or move not in allowed]
        if bad:
            raise ValueError(f"plan_path: agent {agent!r} cannot play {bad[0]!r}: allowed are {', '.join(allowed)}")
        if self.done:
            raise ValueError("plan_path: the episode is over (the token is on the goal); reset first")
        applied, blocked = 0, False
        for move in moves:
            if self.done:
                break
            self._move(agent, allowed[move])
            if self.infos[agent]["blocked"]:
                blocked = True
                break
            applied += 1
        self.infos[agent] = {"blocked": blocked, "moves": applied}

    def team_reward(self) -> float:
        return 1.0 if self.position == self.goal else 0.0

    def action_examples(self, agent: str) -> list[str]:
        """The moves `agent` may play now (for check_env); the shipped movers never play "S"."""
        return [] if self.done else [move for move in MOVES[agent] if move != "S"]

    def distance(self) -> int:
        """BFS shortest-path length from the token to the goal (0 on the goal)."""
        return self.dist[self.position]

    def move_quality(self, agent: str, action: Any, after: PlanPathEnv) -> bool | None:
        """A good move shortens the BFS distance to the goal (`eval/progress_rate/<agent>`)."""
        return after.distance() < self.distance()

    @classmethod
    def reference_policies(cls) -> dict[str, Any]:
        """random (uniform over the mover's two moves; the shipped movers never play "S"), always_<V>_<H> (the
        four constant team answers: a collapsed policy), toward_goal (each mover steps toward the goal on its
        own axis; once aligned, a move that is not blocked, else either), optimal (the move after which the
        fewest alternating team moves are left, `team_moves`: a ceiling)."""
        return dict(REFERENCE_POLICIES)

    def clone(self) -> PlanPathEnv:
        # The problem, walls and distance map are never mutated, so clones share them.
        return self.shallow_clone()

    @classmethod
    def problems(
        cls, split: str, count: int, sizes: list[int] | None = None, density: float = 0.2, first: int = 0
    ) -> list[dict[str, Any]]:
        """Problems `first .. first + count - 1` of `split`; train seed i is i, test seed i is 10**9 + i."""
        check_split(split, count)
        sizes = [4, 5] if sizes is None else list(sizes)
        if not sizes or any(not isinstance(s, int) or s < 2 for s in sizes):
            raise ValueError(f"plan_path: sizes must be a non-empty list of integers >= 2, got {sizes!r}")
        if not 0.0 <= density < 1.0:
            raise ValueError(f"plan_path: density must be in [0, 1), got {density!r}")
        if first < 0 or first + count > TEST_SEED_OFFSET:
            raise ValueError(f"plan_path: problem indices must lie in [0, {TEST_SEED_OFFSET}), got first={first}")
        offset = 0 if split == "train" else TEST_SEED_OFFSET
        return [make_problem(offset + i, sizes, density) for i in range(first, first + count)]


def _parse_problem(problem: dict[str, Any]) -> tuple[int, int, frozenset[Cell], Cell, Cell]:
    missing = [key for key in ("rows", "cols", "walls", "start", "goal") if key not in problem]
    if missing:
        raise ValueError(f"plan_path: problem dict lacks {', '.join(missing)}")
    rows, cols = int(problem["rows"]), int(problem["cols"])
    walls = frozenset((int(r), int(c)) for r, c in problem["walls"])
    start = (int(problem["start"][0]), int(problem["start"][1]))
    goal = (int(problem["goal"][0]), int(problem["goal"][1]))
    for name, cell in (("start", start), ("goal", goal)):
        if not (0 <= cell[0] < rows and 0 <= cell[1] < cols) or cell in walls:
            raise ValueError(f"plan_path: {name} {list(cell)} is off the {rows}x{cols} grid or on a wall")
    return rows, cols, walls, goal, start


# -- reference policies (`PlanPathEnv.reference_policies`) ----------------------------------------


def landing(env: Any, delta: Cell) -> Cell:
    """Where the token ends up after a move by `delta` (where it is, when the move is blocked)."""
    cell = (env.position[0] + delta[0], env.position[1] + delta[1])
    inside = 0 <= cell[0] < env.rows and 0 <= cell[1] < env.cols
    return cell if inside and cell not in env.walls else env.position


@lru_cache(maxsize=65536)
def _team_left(rows: int, cols: int, walls: frozenset[Cell], cell: Cell, goal: Cell, phase: int) -> float:
    left = team_moves(rows, cols, walls, cell, goal, first=phase)
    return math.inf if left is None else left


def _toward_goal(env: Any, agent: str, rng: random.Random) -> str:
    moves, axis = mover_moves(MOVES, agent), 0 if agent == "vertical" else 1
    gap = env.goal[axis] - env.position[axis]
    if gap:
        return next(m for m in moves if MOVES[agent][m][axis] * gap > 0)
    free = [m for m in moves if landing(env, MOVES[agent][m]) != env.position]
    return rng.choice(free or moves)


def _optimal(env: Any, agent: str, rng: random.Random) -> str:
    partner = 1 if agent == "vertical" else 0
    return ties(
        mover_moves(MOVES, agent),
        lambda m: _team_left(env.rows, env.cols, env.walls, landing(env, MOVES[agent][m]), env.goal, partner),
        rng,
    )


REFERENCE_POLICIES: dict[str, ReferencePolicy] = {
    "random": movers_random(MOVES),
    **{f"always_{v}_{h}": movers_constant(MOVES, v, h) for v in "UD" for h in "LR"},
    "toward_goal": _toward_goal,
    "optimal": _optimal,
}
