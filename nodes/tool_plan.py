"""Nodes and workflow of the tool + plan team (Stronger-MAS) on Plan-Path, Sokoban and Sudoku (`envs/tool_plan.py`).

- `ToolAgent` (agent "tool"): prompted with the task, answers with one ```python program that solves it
  (BFS or A* for a path, a search for Sokoban, a solver for Sudoku) and prints the action list after
  `**Actions List**:`. Its action is {"code"}; the env runs the program in the sandbox. Local reward:
  1.0 when the printed actions would solve the problem (applied on a clone of the env), 0.0 when they
  would not, `invalid_penalty` when the program failed, timed out or printed no action list (and, as for
  every node, when the answer holds no parsable ```python block).
- `PlanAgent` (agent "plan"): prompted with the task, the tool's code, its output and its printed
  actions, reasons and ends with the final action list on a line starting with `####`; the env applies
  it as one macro action. Local reward: 1.0 when the problem is solved after it, else 0.0; no `####`
  line, or no action list after it, is a ParseError (`invalid_penalty`).
- `ToolPlanWorkflow` ("tool_plan"): each turn the tool acts, then the plan on the tool's branch, until
  the problem is solved or `max_turns` turns (default 4, the reference's `env.max_turns` for the games);
  with one node only, that role plays alone (the envs and nodes `plan_path_tool_alone` and
  `plan_path_plan_alone`, whose prompts tell the agent it solves alone).

The rewards are the reference's (agents/tool_agent.py, agents/plan_agent.py): each agent's own binary
success, and the team term `alpha * team_reward()` on top (the reference adds the env's reward to each
agent's); under tree sampling the tool's candidates are scored before the plan acts, so the tool's team
term is the state it leaves (unchanged). Per-env subclasses differ only in the answer's format.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from envs.tool_plan import as_grid, as_moves, literal_list
from mas_async.api import Node, ParseError
from nodes.parsing import python_block, strip_thinking
from nodes.sequential import SequentialWorkflow

if TYPE_CHECKING:
    from envs.tool_plan import ToolPlanEnv

TOOL_SYSTEM = """You are the tool agent of a team of two solving a planning problem: you write code, your \
teammate (the plan agent) reads your code, its output and the actions it printed, and decides the answer.
Write ONE ```python program that solves the task below and prints the result with print(). The program \
reads no input: copy what it needs from the task into the code. Use an algorithm such as BFS or A*; \
do not just guess the answer.
"""
PLAN_SYSTEM = """You are the plan agent of a team of two solving a planning problem. You receive the task, \
the tool agent's code, its execution output and the actions it printed. Check them against the task: if \
they are correct, adopt them; otherwise correct them with your own reasoning. Think step by step, \
briefly, then give the final action list on the LAST line, after ####.
"""
TOOL_ALONE_SYSTEM = """You solve a planning problem alone, by writing code: the action list your program prints \
is applied to the grid.
Write ONE ```python program that solves the task below and prints the result with print(). The program \
reads no input: copy what it needs from the task into the code. Use an algorithm such as BFS or A*; \
do not just guess the answer.
"""
PLAN_ALONE_SYSTEM = """You solve a planning problem alone: the action list you answer is applied to the grid. \
Think step by step, briefly, then give the final action list on the LAST line, after ####.
"""
MOVES_TOOL = """Moves are "U" (up), "D" (down), "L" (left), "R" (right). If your algorithm numbers them, \
convert them with action_map = {0: "U", 1: "D", 2: "L", 3: "R"} before printing. The program must print \
the move list (all of it, or the part you are sure of) in exactly this format:
**Actions List**: ["U", "R", "D", "L"]"""
MOVES_PLAN = """Format: the last line is #### followed by a JSON list of moves, e.g.
#### ["U", "R", "D", "L"]"""
GRID_TOOL = """The program must print the complete solved grid in exactly this format (a 4x4 example):
**Actions List**: [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]"""
GRID_PLAN = """Format: the last line is #### followed by the complete solved grid as a JSON list of rows, e.g.
#### [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]"""
SOKOBAN_HINTS = """
Hints: to push a box at (br, bc) by (dr, dc), the keeper must reach (br - dr, bc - dc) and the cell \
(br + dr, bc + dc) must be free; search over (keeper, boxes) states; avoid pushing a box into a corner \
that is not a target."""


class ToolAgent(Node):
    """Writes a program whose printed action list is scored on a clone (see the module docstring)."""

    system = TOOL_SYSTEM
    answer_format = MOVES_TOOL

    def __init__(self, agent: str = "tool") -> None:
        super().__init__(agent)

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system + self.answer_format}, {"role": "user", "content": str(obs)}]

    def parse(self, text: str) -> dict[str, str]:
        return {"code": python_block(text, self.agent)}

    def local_reward(self, before: ToolPlanEnv, action: Any, after: ToolPlanEnv) -> float:
        if not after.infos[self.agent]["parsed"]:
            return self.invalid_penalty
        # Scored from the state it acted on (alone, the tool's actions have moved the board since).
        return 1.0 if before.achieves(after.infos[self.agent]["actions"]) else 0.0


class PlanAgent(Node):
    """Answers with the final action list after `####` (see the module docstring)."""

    system = PLAN_SYSTEM
    answer_format = MOVES_PLAN
    expected = "a list of moves U, D, L, R"

    def __init__(self, agent: str = "plan") -> None:
        super().__init__(agent)

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system + self.answer_format}, {"role": "user", "content": str(obs)}]

    def parse(self, text: str) -> Any:
        marked = [line.lstrip()[4:] for line in strip_thinking(text).splitlines() if line.lstrip().startswith("####")]
        if not marked:
            raise ParseError(f"{self.agent}: no final answer after ####")
        action = self.read(literal_list(marked[-1]))
        if action is None:
            raise ParseError(f"{self.agent}: the answer after #### is not {self.expected}: {marked[-1][:40]!r}")
        return action

    def read(self, value: list | None) -> Any:
        return as_moves(value)

    def local_reward(self, before: ToolPlanEnv, action: Any, after: ToolPlanEnv) -> float:
        return 1.0 if after.success() else 0.0


class PlanPathTool(ToolAgent):
    """Plan-Path's tool agent: prints a path as a list of moves."""


class PlanPathPlan(PlanAgent):
    """Plan-Path's plan agent: answers a list of moves."""


class PlanPathToolAlone(PlanPathTool):
    """Plan-Path's tool agent playing alone (env `plan_path_tool_alone`): told its printed actions are applied."""

    system = TOOL_ALONE_SYSTEM


class PlanPathPlanAlone(PlanPathPlan):
    """Plan-Path's plan agent playing alone (env `plan_path_plan_alone`): shown no program."""

    system = PLAN_ALONE_SYSTEM


class SokobanTool(ToolAgent):
    """Sokoban's tool agent: prints a list of moves, with the reference's search hints."""

    answer_format = MOVES_TOOL + SOKOBAN_HINTS


class SokobanPlan(PlanAgent):
    """Sokoban's plan agent: answers a list of moves."""


class SudokuTool(ToolAgent):
    """Sudoku's tool agent: prints the complete solved grid."""

    answer_format = GRID_TOOL


class SudokuPlan(PlanAgent):
    """Sudoku's plan agent: answers the complete solved grid."""

    answer_format = GRID_PLAN
    expected = "a square grid of digits"

    def read(self, value: list | None) -> Any:
        return as_grid(value)


class ToolPlanWorkflow(SequentialWorkflow):
    """Each turn the tool acts, then the plan on the tool's committed branch; the episode stops when the
    problem is solved or after `max_turns` turns. Given one of the two nodes only (a role alone:
    `plan_path_tool_alone`, `plan_path_plan_alone`), that one acts each turn."""

    agents = ("tool", "plan")

    def __init__(self, nodes: dict[str, Node], max_turns: int = 4) -> None:
        present = tuple(agent for agent in type(self).agents if agent in nodes)
        if len(present) == 1 and set(nodes) == set(present):
            self.agents = present
        super().__init__(nodes, max_turns)
