"""The tool + plan team's envs (Stronger-MAS): Plan-Path, Sokoban and Sudoku played by "tool" and "plan".

The paper's team for games and planning (the reference is PettingLLMs, `multi_agent_env/stateful/`):
each turn a tool agent writes a Python program that prints an action list, then a plan agent, shown the
program, its output and the actions it printed, answers with the action list the env applies. The same
problems, grids and rules as `envs.plan_path`, `envs.sokoban` and `envs.sudoku`; what differs is the
agents and their actions:

- "tool": {"code": str}. `astep` runs the program in the sandbox (`mas_async.api.run_python`, never in
  this process) and reads the action list it printed after `**Actions List**:` (else the last line that
  is a list literal). The state does not move: the program and what it printed are recorded for the
  plan agent, and `achieves(actions)` says whether they would solve the problem (applied on a clone).
  `infos["tool"]` = {"status": the sandbox status, "parsed": whether an action list was read, "actions":
  the list read, or None}.
- "plan": a macro action. Plan-Path and Sokoban: a list of moves "U", "D", "L", "R", applied in order,
  stopping at the goal (solved level) or at the first blocked move; Sudoku: a complete grid, written if it
  is the solution (checked mode), else nothing changes. `infos["plan"]` = {"solved", ...}.

The reference's rewards are binary, and so is `team_reward()` here (1.0 when solved). Unlike the
reference, a macro action stops at a blocked move (the reference skips it and goes on) and Sokoban has
no step limit or deadlock end: the workflow's turn limit ends the episode.

Each role alone, for the paper's probe "trained as single agents, then combined" (`bench/ablation.py`):
`plan_path_tool_alone` (agent "tool" only: the actions its program prints are applied as the macro
action) and `plan_path_plan_alone` (agent "plan" only: the task and the history, no program). Policies
trained there play together in `plan_path_toolplan`.

The observation is the task (the current grid as text), the previous turns' history (each turn's code,
first and last 250 characters, its output, first and last 150, the tool's and the plan's actions, as
the reference formats it) and, for the plan agent, the current turn's code, output and printed actions.
"""

from __future__ import annotations

import ast
import hashlib
import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from envs.plan_path import MOVES as PLAN_PATH_MOVES
from envs.plan_path import REFERENCE_POLICIES as PLAN_PATH_MOVERS
from envs.plan_path import PlanPathEnv, landing
from envs.sokoban import AGENTS as SOKOBAN_AGENTS
from envs.sokoban import MOVES as SOKOBAN_MOVES
from envs.sokoban import REFERENCE_POLICIES as SOKOBAN_MOVERS
from envs.sokoban import SokobanEnv, move
from envs.sudoku import BOX, SudokuEnv
from mas_async.api import Env, Limits, ReferencePolicy, RunCache, run_python, run_sync

AGENTS = ("tool", "plan")
MARKER = "**Actions List**:"
FOUR_MOVES: dict[str, tuple[int, int]] = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
# The reference runs the tool's program with a 20 s timeout (agents/tool_agent.py).
TOOL_LIMITS = Limits(timeout_s=20.0, cpu_s=20)
HISTORY_CODE_CHARS, HISTORY_OUTPUT_CHARS = 500, 300  # the reference's truncation of past turns
SHOWN_CODE_CHARS, SHOWN_OUTPUT_CHARS = 4000, 2000  # bounds on the current turn's code and output


def truncate(text: str, length: int) -> str:
    """`text`, or its first and last `length // 2` characters around a "...(truncated)..." mark."""
    return text if len(text) <= length else text[: length // 2] + "...(truncated)..." + text[-(length // 2) :]


def literal_list(text: str) -> list | None:
    """The list literal that `text` starts with (after spaces), read with `ast.literal_eval` (never
    `eval`: the text is model-written); None if there is none."""
    stripped = text.lstrip()
    if not stripped.startswith("["):
        return None
    depth = 0
    for end, ch in enumerate(stripped):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth == 0:
            try:
                value = ast.literal_eval(stripped[: end + 1])
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                return None
            return value if isinstance(value, list) else None
    return None


def printed_list(stdout: str) -> list | None:
    """The action list a tool program printed: after the last `**Actions List**:`, else the last line
    that is a list literal (the reference's fallback); None when it printed none."""
    at = stdout.rfind(MARKER)
    if at >= 0:
        return literal_list(stdout[at + len(MARKER) :])
    for line in reversed(stdout.splitlines()):
        value = literal_list(line)
        if value is not None:
            return value
    return None


def as_moves(value: Any) -> list[str] | None:
    """`value` as a list of moves "U", "D", "L", "R" (case and spaces ignored), or None."""
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        return None
    moves = [m.strip().upper() for m in value]
    return moves if all(m in FOUR_MOVES for m in moves) else None


def as_grid(value: Any) -> list[list[int]] | None:
    """`value` as a non-empty square grid of integers (a Sudoku answer of any size), or None."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(row, list) and len(row) == len(value) for row in value):
        return None
    if not all(isinstance(d, int) and not isinstance(d, bool) for row in value for d in row):
        return None
    return [list(row) for row in value]


class ToolPlanEnv(Env):
    """What the three tool + plan envs share (a mixin: `class X(ToolPlanEnv, GameEnv)`): the agents,
    the tool's sandbox runs, the history and the observations. A subclass gives `task`, `read_actions`,
    `apply` and `answer`."""

    actions = {
        "tool": '{"code": str}: a Python program, run in the sandbox, that prints an action list after '
        '"**Actions List**:" (the state does not move; the plan agent is shown the program, its output and the list)',
        "plan": "a macro action: a list of moves U, D, L, R applied in order, stopping at the goal or the first "
        "blocked move (Plan-Path, Sokoban); a complete grid, a list of rows of digits, written if it is the "
        "solution (Sudoku)",
    }
    rewards = (
        "team_reward() is 1.0 once the problem is solved (the episode ends), else 0.0 (Sokoban: the fraction of "
        "boxes on targets); the workflow's turn limit ends an unsolved episode"
    )
    info_keys = {
        "tool": {
            "status": "the sandbox's status of the program's run (ok, error, timeout, ...)",
            "parsed": "an action list was read from its output",
            "actions": "the action list read, or None",
            "applied": "tool alone: the moves of that list applied",
        },
        "plan": {
            "solved": "the macro action solved the problem",
            "blocked": "Plan-Path, Sokoban: it stopped at a blocked move",
            "moves": "Plan-Path, Sokoban: the moves applied",
        },
    }

    possible_agents = list(AGENTS)
    runs_code = True
    tool_limits: Limits = TOOL_LIMITS

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        super().reset(seed=seed, options=options)
        # One dict per turn {"code", "output", "tool", "plan"}; replaced, never mutated, so clones share it.
        self.turns: tuple[dict[str, Any], ...] = ()
        self._runs = RunCache()  # shared by clones on purpose: K equal programs run once
        self.infos = {"tool": {"status": None, "parsed": False}, "plan": {"solved": False}}

    # -- what a subclass gives --------------------------------------------------------------------

    def task(self) -> str:
        """The problem in its current state, as text for both agents."""
        raise NotImplementedError

    def read_actions(self, value: list | None) -> Any:
        """The macro action in a list the tool printed, or None when it is not one."""
        raise NotImplementedError

    def apply(self, action: Any) -> dict[str, Any]:
        """Apply the plan's macro action; return `infos["plan"]` (with "solved"). Raises ValueError,
        changing nothing, for an action of the wrong type."""
        raise NotImplementedError

    def answer(self) -> Any:
        """A macro action that solves the problem from here (for `action_examples`)."""
        raise NotImplementedError

    # -- the env API ------------------------------------------------------------------------------

    def observe(self, agent: str) -> str:
        """The task, the history of previous turns, and for the plan agent the tool's current turn."""
        _check_agent(agent)
        current = self.turns[-1] if self.turns and self.turns[-1]["plan"] is None else None
        past = self.turns[:-1] if current is not None else self.turns
        parts = [self.task()]
        if past:
            parts.append(_history(past))
        if agent == "plan" and current is not None:
            parts.append(
                f"Here is the tool agent's code:\n```python\n{truncate(current['code'], SHOWN_CODE_CHARS)}\n```"
            )
            parts.append(f"Here is its execution output:\n{truncate(current['output'], SHOWN_OUTPUT_CHARS)}")
            parts.append(f"Here are the actions it printed: {current['tool']}")
        return "\n\n".join(parts)

    async def astep(self, agent: str, action: Any) -> None:
        """Run the tool's program in the sandbox (awaited, so K programs overlap), or apply the plan."""
        _check_agent(agent)
        if agent == "plan":
            self.step(agent, action)
            return
        if not isinstance(action, dict) or not isinstance(action.get("code"), str):
            raise TypeError(f"{type(self).__name__}: the tool's action is {{'code': str}}, got {action!r:.80}")
        if self.done:
            raise ValueError(f"{type(self).__name__}: the episode is over; reset first")
        code = action["code"]
        key = hashlib.sha256(code.encode()).hexdigest()
        result = await self._runs.get(key, lambda: run_python(code, limits=self.tool_limits))
        actions = self.read_actions(printed_list(result.stdout)) if result.ok else None
        output = result.stdout if result.ok else f"{result.stdout}\n{result.stderr}\n[{result.status}: {result.detail}]"
        self.turns = (*self.turns, {"code": code, "output": output.strip(), "tool": actions, "plan": None})
        self.infos["tool"] = {"status": result.status, "parsed": actions is not None, "actions": actions}

    def step(self, agent: str, action: Any) -> None:
        """The plan's macro action; the tool's program runs through `astep` (synchronously here)."""
        _check_agent(agent)
        if agent == "tool":
            run_sync(lambda: self.astep(agent, action))
            return
        if self.done:
            raise ValueError(f"{type(self).__name__}: the episode is over; reset first")
        info = self.apply(action)
        if self.turns and self.turns[-1]["plan"] is None:
            self.turns = (*self.turns[:-1], {**self.turns[-1], "plan": action})
        else:
            self.turns = (*self.turns, {"code": None, "output": "", "tool": None, "plan": action})
        self.infos["plan"] = info

    @property
    def tool_actions(self) -> Any:
        """The action list the tool printed this turn (None: it printed none, or has not acted yet)."""
        return self.turns[-1]["tool"] if self.turns and self.turns[-1]["plan"] is None else None

    def achieves(self, action: Any) -> bool:
        """Whether the macro action would solve the problem from here (applied on a clone)."""
        if self.done:
            return self.success()
        trial = self.clone()
        trial.apply(action)
        return trial.success()

    def action_examples(self, agent: str) -> list[Any]:
        """For `envs.check.check_env`: a program printing the solution; for the plan, the solution and
        its first move alone (Sudoku: the solution and an empty grid)."""
        _check_agent(agent)
        if self.done:
            return []
        answer = self.answer()
        if agent == "tool":
            return [{"code": f"print({MARKER!r}, {answer!r})"}]
        return [answer, self.wrong_example()]

    def wrong_example(self) -> Any:
        return self.answer()[:1]

    def move_quality(self, agent: str, action: Any, after: Env) -> bool | None:
        """No judgement here (Plan-Path's team judges the plan's moves: `PlanPathToolPlanEnv`)."""
        return None


class PlanPathToolPlanEnv(ToolPlanEnv, PlanPathEnv):
    """Plan-Path for the tool + plan team: the plan moves the walker in all four directions."""

    def moves_of(self, agent: str) -> dict[str, tuple[int, int]]:
        _check_agent(agent)
        return FOUR_MOVES

    def task(self) -> str:
        rows = []
        for r in range(self.rows):
            row = ""
            for c in range(self.cols):
                cell = (r, c)
                row += (
                    "A" if cell == self.position else "G" if cell == self.goal else "#" if cell in self.walls else "."
                )
            rows.append(row)
        grid = "\n".join(rows)
        return (
            f"Grid ('.' free, '#' blocked, 'A' the walker, 'G' the goal; {self.rows} rows, {self.cols} columns):\n"
            f"```\n{grid}\n```\n"
            f"Position: {self.position},  Goal: {self.goal} (row, column; row 0 at the top, column 0 at the left)\n"
            "Rules: moves are U (row - 1), D (row + 1), L (column - 1), R (column + 1); stay within bounds; "
            "do not cross '#'."
        )

    def read_actions(self, value: list | None) -> list[str] | None:
        return as_moves(value)

    def apply(self, action: Any) -> dict[str, Any]:
        if not isinstance(action, list):
            raise ValueError(f"plan_path: the plan's action is a list of moves, got {action!r:.80}")
        self.play("plan", action)
        return {**self.infos["plan"], "solved": self.success()}

    def move_quality(self, agent: str, action: Any, after: Env) -> bool | None:
        """The plan's macro action is good when it shortens the distance to the goal, as a mover's move;
        the tool's program moves nothing."""
        return None if agent == "tool" else PlanPathEnv.move_quality(self, agent, action, after)

    @classmethod
    def reference_policies(cls) -> dict[str, Any]:
        """The Plan-Path movers' reference policies, one movers' turn per team turn, and solver (the
        shortest path): see "Reference policies" at the end of this module."""
        return dict(PLAN_PATH_POLICIES)

    def answer(self) -> list[str]:
        # Walk down the BFS distance map (shared with the env) to the goal.
        path, cell = [], self.position
        while cell != self.goal:
            for letter, (dr, dc) in FOUR_MOVES.items():
                nxt = (cell[0] + dr, cell[1] + dc)
                if self.dist.get(nxt, -1) == self.dist[cell] - 1:
                    path.append(letter)
                    cell = nxt
                    break
        return path


class PlanPathToolAloneEnv(PlanPathToolPlanEnv):
    """Plan-Path played by the tool agent alone: the actions its program prints are the macro action."""

    possible_agents = ["tool"]

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        super().reset(seed=seed, options=options)
        self.infos = {"tool": self.infos["tool"]}

    async def astep(self, agent: str, action: Any) -> None:
        """Run the program, then apply the actions it printed; `infos["tool"]["applied"]` says how far
        they went (the plan's infos in the team)."""
        await super().astep(agent, action)
        actions = self.infos["tool"]["actions"]
        applied = self.apply(actions) if actions is not None else {"solved": False}
        self.infos.pop("plan", None)
        self.infos["tool"] = {**self.infos["tool"], "applied": applied}
        self.turns = (*self.turns[:-1], {**self.turns[-1], "plan": actions})

    def action_examples(self, agent: str) -> list[Any]:
        _check_agent(agent, self.possible_agents)
        return super().action_examples(agent)

    def move_quality(self, agent: str, action: Any, after: Env) -> bool | None:
        """Alone, the tool's printed actions move the walker: judged as the plan's would be."""
        return PlanPathEnv.move_quality(self, agent, action, after)


class PlanPathPlanAloneEnv(PlanPathToolPlanEnv):
    """Plan-Path played by the plan agent alone: it sees the task and the history of its own answers."""

    possible_agents = ["plan"]

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        super().reset(seed=seed, options=options)
        self.infos = {"plan": self.infos["plan"]}

    def action_examples(self, agent: str) -> list[Any]:
        _check_agent(agent, self.possible_agents)
        return super().action_examples(agent)


class SokobanToolPlanEnv(ToolPlanEnv, SokobanEnv):
    """Sokoban for the tool + plan team: the plan moves the keeper in all four directions."""

    def task(self) -> str:
        keeper, boxes = self.state
        board, rows = self.board, []
        for r in range(board.rows):
            row = ""
            for c in range(board.cols):
                cell, target = (r, c), (r, c) in board.targets
                if cell == keeper:
                    row += "Y" if target else "A"
                elif cell in boxes:
                    row += "X" if target else "B"
                else:
                    row += "#" if cell in board.walls else "T" if target else "."
            rows.append(row)
        on_target = sum(box in board.targets for box in boxes)
        grid = "\n".join(rows)
        return (
            "Sokoban: push every box onto a target.\n"
            "Legend: '#' wall, '.' floor, 'A' the keeper, 'B' a box, 'T' a target, 'X' a box on a target, "
            "'Y' the keeper on a target.\n"
            "Moves: U (row - 1), D (row + 1), L (column - 1), R (column + 1); the keeper cannot walk through "
            "walls; walking into a box pushes it one cell if the cell beyond is free.\n"
            f"Boxes on targets: {on_target}/{len(boxes)}\n"
            f"Keeper: {keeper}, boxes: {list(boxes)}, targets: {sorted(board.targets)} (row, column from 0)\n"
            f"Current state:\n```\n{grid}\n```"
        )

    def read_actions(self, value: list | None) -> list[str] | None:
        return as_moves(value)

    def apply(self, action: Any) -> dict[str, Any]:
        if not isinstance(action, list) or any(not isinstance(m, str) or m not in FOUR_MOVES for m in action):
            raise ValueError(f"sokoban: the plan's action is a list of moves U, D, L, R, got {action!r:.80}")
        applied, blocked = 0, False
        for letter in action:
            if self.board.solved(self.state):
                break
            state, blocked = move(self.board, self.state, FOUR_MOVES[letter])
            if blocked:
                break
            self.state = state
            applied += 1
        solved = self.board.solved(self.state)
        if solved:
            self.terminations = {a: True for a in self.possible_agents}
        return {"blocked": blocked, "moves": applied, "solved": solved}

    @classmethod
    def reference_policies(cls) -> dict[str, Any]:
        """The Sokoban movers' reference policies, one movers' turn per team turn, and solver: see
        "Reference policies" at the end of this module."""
        return dict(SOKOBAN_POLICIES)

    def answer(self) -> list[str]:
        # Breadth-first over (keeper, boxes) with free moves; generated levels are small (one box).
        start = self.state
        parent: dict[Any, tuple[Any, str] | None] = {start: None}
        frontier = [start]
        while frontier:
            nxt_frontier = []
            for state in frontier:
                if self.board.solved(state):
                    path = []
                    while parent[state] is not None:
                        state, letter = parent[state]
                        path.append(letter)
                    return path[::-1]
                for letter, delta in FOUR_MOVES.items():
                    child, blocked = move(self.board, state, delta)
                    if not blocked and child not in parent:
                        parent[child] = (state, letter)
                        nxt_frontier.append(child)
            frontier = nxt_frontier
        return []


class SudokuToolPlanEnv(ToolPlanEnv, SudokuEnv):
    """Sudoku for the tool + plan team: the plan answers with the complete grid."""

    def task(self) -> str:
        n, b = self.size, BOX[self.size]
        rows = "\n".join(" ".join(str(d) if d else "." for d in row) for row in self.grid)
        return (
            f"Solve the {n}x{n} Sudoku. Fill digits 1..{n}; every row, column and {b}x{b} box must hold each "
            f"digit once. Empty cells are '.'.\nCurrent puzzle:\n```\n{rows}\n```"
        )

    def read_actions(self, value: list | None) -> list[list[int]] | None:
        return as_grid(value)

    def apply(self, action: Any) -> dict[str, Any]:
        return {"solved": self.fill_grid(action)}

    @classmethod
    def reference_policies(cls) -> dict[str, Any]:
        """random (a random digit in every empty cell) and solver (the solution grid): see "Reference
        policies" at the end of this module."""
        return dict(SUDOKU_POLICIES)

    def answer(self) -> list[list[int]]:
        return [row[:] for row in self.solution]

    def wrong_example(self) -> Any:
        return [[0] * self.size for _ in range(self.size)]


def _check_agent(agent: str, agents: list[str] | tuple[str, ...] = AGENTS) -> None:
    if agent not in agents:
        raise ValueError(f"tool_plan: unknown agent {agent!r}: agents are {', '.join(agents)}")


def _history(turns: tuple[dict[str, Any], ...]) -> str:
    lines = ["=== HISTORY FROM PREVIOUS TURNS ==="]
    for number, turn in enumerate(turns, 1):
        lines.append(f"--- Turn {number} ---")
        if turn["code"] is not None:
            lines.append(f"Tool Agent's Code:\n{truncate(turn['code'], HISTORY_CODE_CHARS)}")
            lines.append(f"Execution Output:\n{truncate(turn['output'], HISTORY_OUTPUT_CHARS)}")
            lines.append(f"Tool Agent's Action: {turn['tool']}")
        lines.append(f"Plan Agent's Action: {turn['plan']}")
    lines.append("=== END OF HISTORY ===")
    return "\n".join(lines)


# -- Reference policies ---------------------------------------------------------------------------
#
# Each movers' policy (envs/plan_path.py, envs/sokoban.py) plays one movers' turn per team turn, so the two
# teams' baselines are the same on the same problems: the vertical mover's move, then the horizontal mover's
# on the state it left (a blocked move is left out: in the movers' game it leaves the token or keeper in
# place), which the tool prints from a program and the plan adopts (alone, the plan computes it). Each env
# also has `solver`: the tool prints `answer()` (the breadth-first solution, Sudoku's solution grid), the plan
# adopts it: the team's own ceiling.

Turn = Callable[[Any, random.Random], Any]
"""`(env, rng) -> macro action`: what the tool + plan team's baseline plays in one turn."""


def plan_path_turn(policy: ReferencePolicy) -> Turn:
    """One movers' turn of `policy` on a Plan-Path grid, as a list of moves."""

    def turn(env: Any, rng: random.Random) -> list[str]:
        view = SimpleNamespace(rows=env.rows, cols=env.cols, walls=env.walls, goal=env.goal, position=env.position)
        moves = []
        for agent in ("vertical", "horizontal"):
            if view.position == view.goal:
                break
            letter = policy(view, agent, rng)
            cell = landing(view, PLAN_PATH_MOVES[agent][letter])
            if cell != view.position:
                view.position = cell
                moves.append(letter)
        return moves

    return turn


def sokoban_turn(policy: ReferencePolicy) -> Turn:
    """One movers' turn of `policy` on a Sokoban level, as a list of moves."""

    def turn(env: Any, rng: random.Random) -> list[str]:
        view = SimpleNamespace(board=env.board, start=env.start, state=env.state)
        moves = []
        for agent in SOKOBAN_AGENTS:
            if view.board.solved(view.state):
                break
            letter = policy(view, agent, rng)
            state, blocked = move(view.board, view.state, SOKOBAN_MOVES[agent][letter])
            if not blocked:
                view.state = state
                moves.append(letter)
        return moves

    return turn


def solver_turn(env: Any, rng: random.Random) -> Any:
    """The whole solution from here (`ToolPlanEnv.answer`)."""
    return env.answer()


def random_grid_turn(env: Any, rng: random.Random) -> list[list[int]]:
    """The grid with a random digit in every empty cell."""
    return [[d or rng.randint(1, env.size) for d in row] for row in env.grid]


def tool_plan(turn: Turn) -> ReferencePolicy:
    """The tool + plan team playing `turn`: the tool's program prints it, the plan adopts what the tool
    printed (alone, or when the program printed nothing, it plays `turn` itself)."""

    def policy(env: Any, agent: str, rng: random.Random) -> Any:
        if agent == "tool":
            return {"code": f"print({MARKER!r}, {turn(env, rng)!r})"}
        if agent == "plan":
            printed = env.tool_actions
            return printed if printed is not None else turn(env, rng)
        raise ValueError(f"tool_plan: a reference policy plays tool or plan, not {agent!r}")

    return policy


PLAN_PATH_POLICIES: dict[str, ReferencePolicy] = {
    **{name: tool_plan(plan_path_turn(policy)) for name, policy in PLAN_PATH_MOVERS.items()},
    "solver": tool_plan(solver_turn),
}
SOKOBAN_POLICIES: dict[str, ReferencePolicy] = {
    **{name: tool_plan(sokoban_turn(policy)) for name, policy in SOKOBAN_MOVERS.items()},
    "solver": tool_plan(solver_turn),
}
SUDOKU_POLICIES: dict[str, ReferencePolicy] = {
    "random": tool_plan(random_grid_turn),
    "solver": tool_plan(solver_turn),
}
