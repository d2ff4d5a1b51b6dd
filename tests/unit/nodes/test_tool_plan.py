"""The tool + plan team through the real episode code with scripted completions: the tool's programs run
in the sandbox and are scored on clones, the plan's `####` answer is applied as one macro action."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from envs.tool_plan import (
    PlanPathPlanAloneEnv,
    PlanPathToolAloneEnv,
    PlanPathToolPlanEnv,
    SokobanToolPlanEnv,
    SudokuToolPlanEnv,
)
from mas_async.api import Limits, ParseError, resolve
from nodes import NODES, WORKFLOWS
from nodes.tool_plan import (
    PlanPathPlan,
    PlanPathPlanAlone,
    PlanPathTool,
    PlanPathToolAlone,
    SokobanPlan,
    SokobanTool,
    SudokuPlan,
    SudokuTool,
)
from tests.support.chat_fakes import ScriptedGenerate, make_episode
from tests.unit.envs.test_macro_actions import DETOUR, PUSH, SOLVE

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run one at a time (make test)

AGENTS = ("tool", "plan")
SHORT = Limits(timeout_s=1.0, cpu_s=1)

BFS = """from collections import deque
rows, cols, walls = {rows}, {cols}, {{tuple(w) for w in {walls}}}
start, goal = {start}, {goal}
moves = {{"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}}
prev = {{start: None}}
queue = deque([start])
while queue:
    cell = queue.popleft()
    for name, (dr, dc) in moves.items():
        nxt = (cell[0] + dr, cell[1] + dc)
        if 0 <= nxt[0] < rows and 0 <= nxt[1] < cols and nxt not in walls and nxt not in prev:
            prev[nxt] = (cell, name)
            queue.append(nxt)
path, cell = [], goal
while prev[cell] is not None:
    cell, name = prev[cell]
    path.append(name)
print("**Actions List**:", path[::-1])
"""
SOKOBAN_BFS = """from collections import deque
walls, targets = {walls}, {targets}
start = ({player}, tuple(sorted({boxes})))
moves = {{"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}}
prev, queue = {{start: None}}, deque([start])
while queue:
    state = queue.popleft()
    if set(state[1]) <= targets:
        break
    (r, c), boxes = state
    for name, (dr, dc) in moves.items():
        ahead = (r + dr, c + dc)
        if ahead in walls:
            continue
        if ahead in boxes:
            beyond = (ahead[0] + dr, ahead[1] + dc)
            if beyond in walls or beyond in boxes:
                continue
            boxes2 = tuple(sorted(beyond if b == ahead else b for b in boxes))
        else:
            boxes2 = boxes
        nxt = (ahead, boxes2)
        if nxt not in prev:
            prev[nxt] = (state, name)
            queue.append(nxt)
path = []
while prev[state] is not None:
    state, name = prev[state]
    path.append(name)
print("**Actions List**:", path[::-1])
"""
SUDOKU_SOLVER = """grid = {grid}
n, b = len(grid), int(len(grid) ** 0.5)
def ok(r, c, d):
    if d in grid[r] or any(grid[i][c] == d for i in range(n)):
        return False
    top, left = r - r % b, c - c % b
    return all(grid[i][j] != d for i in range(top, top + b) for j in range(left, left + b))
def solve():
    for r in range(n):
        for c in range(n):
            if grid[r][c] == 0:
                for d in range(1, n + 1):
                    if ok(r, c, d):
                        grid[r][c] = d
                        if solve():
                            return True
                        grid[r][c] = 0
                return False
    return True
solve()
print("**Actions List**:", grid)
"""


def fenced(code: str) -> str:
    return f"I will search the grid with BFS.\n```python\n{code}```\n"


def printing(actions: object) -> str:
    return fenced(f"print('**Actions List**:', {actions!r})\n")


def bfs(problem: dict) -> str:
    return fenced(BFS.format(**{k: tuple(v) if k in ("start", "goal") else v for k, v in problem.items()}))


def plan_path_env(**limits: Limits) -> PlanPathToolPlanEnv:
    env = PlanPathToolPlanEnv()
    env.reset(options={"problem": DETOUR})
    env.tool_limits = limits.get("limits", SHORT)
    return env


def workflow(max_turns: int = 4, tool=PlanPathTool, plan=PlanPathPlan):
    return resolve("tool_plan", WORKFLOWS, "workflow")({"tool": tool(), "plan": plan()}, max_turns=max_turns)


def rewards(episode, agent: str, turn: int) -> list[float]:
    return [s.reward for s in episode.samples if s.agent == agent and s.turn == turn]


def prompt_text(episode, agent: str, turn: int) -> str:
    sample = next(s for s in episode.samples if s.agent == agent and s.turn == turn)
    return "".join(chr(i) for i in np.asarray(sample.prompt_ids))


def test_registered_keys() -> None:
    for key in ("plan_path_tool", "plan_path_plan", "sokoban_tool", "sokoban_plan", "sudoku_tool", "sudoku_plan"):
        assert resolve(key, NODES, "node")
    assert resolve("tool_plan", WORKFLOWS, "workflow").agents == AGENTS


def test_a_bfs_program_and_a_plan_that_adopts_it_solve_in_one_turn() -> None:
    generate = ScriptedGenerate(
        {
            "tool": [[bfs(DETOUR), fenced("raise RuntimeError('no path')\n")]],
            "plan": [[f"The tool's path avoids the wall.\n#### {SOLVE}", "Go right, then up."]],
        }
    )
    episode = make_episode(plan_path_env(), AGENTS, generate, k=2)
    asyncio.run(workflow().run(episode))
    assert generate.calls == [("tool", 2), ("plan", 2)]
    # tool: its printed path solves on a clone (1.0, the team term is 0: nothing moved); the crash: penalty
    assert rewards(episode, "tool", 0) == [1.0, -1.0]
    # plan: alpha * team reward 1 + its own success 1, as the reference credits it; no #### line: penalty
    assert rewards(episode, "plan", 0) == [2.0, -1.0]
    assert episode.env.success() and episode.env.position == (0, 2)
    assert episode.finish()["turns"] == 1 and episode.episode_return == 3.0
    plan_prompt = prompt_text(episode, "plan", 0)
    assert f"Here are the actions it printed: {SOLVE}" in plan_prompt and "from collections import deque" in plan_prompt


def test_a_wrong_program_and_a_correcting_plan() -> None:
    generate = ScriptedGenerate(
        {
            "tool": [[printing(["D", "D"]), fenced("print('I do not know')\n")]],
            "plan": [[f"The tool stops short of the goal: go on.\n#### {SOLVE}", '#### ["D", "D"]']],
        }
    )
    episode = make_episode(plan_path_env(), AGENTS, generate, k=2)
    asyncio.run(workflow().run(episode))
    assert rewards(episode, "tool", 0) == [0.0, -1.0]  # runs but does not solve: 0; prints no list: penalty
    assert rewards(episode, "plan", 0) == [2.0, 0.0]
    assert episode.env.success()


def test_a_hanging_program_gets_the_penalty_and_the_episode_goes_on() -> None:
    generate = ScriptedGenerate(
        {
            "tool": [[fenced("while True:\n    pass\n")], [bfs(DETOUR)]],
            "plan": [['Without a tool answer I try down.\n#### ["D"]'], [f"#### {SOLVE[1:]}"]],
        }
    )
    episode = make_episode(plan_path_env(), AGENTS, generate, k=1)
    asyncio.run(workflow(max_turns=2).run(episode))
    assert rewards(episode, "tool", 0) == [-1.0] and rewards(episode, "plan", 0) == [0.0]
    assert rewards(episode, "plan", 1) == [2.0] and episode.env.success()
    # turn 2's prompts carry turn 1 as history; the tool's BFS starts from the moved walker, so it prints
    # a path that no longer solves from there (0.0)
    assert rewards(episode, "tool", 1) == [0.0]
    history = prompt_text(episode, "tool", 1)
    # A hanging program ends at the wall-clock bound or, on an idle machine, first at its CPU limit (SIGXCPU).
    assert "--- Turn 1 ---" in history and "Plan Agent's Action: ['D']" in history
    assert "[timeout" in history or "killed by SIGXCPU" in history, history


def test_the_k_programs_run_concurrently() -> None:
    sleepy = [
        fenced(f"import time\ntime.sleep(2)  # candidate {i}\nprint('**Actions List**:', {SOLVE!r})\n")
        for i in range(2)
    ]
    generate = ScriptedGenerate({"tool": [sleepy]})
    episode = make_episode(plan_path_env(limits=Limits(timeout_s=10.0, cpu_s=5)), AGENTS, generate, k=2)
    started = time.monotonic()
    candidates = asyncio.run(episode.sample(PlanPathTool()))
    assert [c.reward for c in candidates] == [1.0, 1.0]
    assert time.monotonic() - started < 3.9  # two 2 s programs, one after the other, would take 4 s


def test_sokoban_and_sudoku_teams_solve_with_a_solver_program() -> None:
    sokoban = SokobanToolPlanEnv()
    sokoban.reset(options={"problem": PUSH})
    walls = {tuple(w) for w in PUSH["walls"]}
    code = SOKOBAN_BFS.format(
        walls=walls, targets={(1, 2)}, player=tuple(PUSH["player"]), boxes=[tuple(b) for b in PUSH["boxes"]]
    )
    generate = ScriptedGenerate({"tool": [[fenced(code)]], "plan": [['#### ["U"]']]})
    episode = make_episode(sokoban, AGENTS, generate, k=1)
    asyncio.run(workflow(tool=SokobanTool, plan=SokobanPlan).run(episode))
    assert rewards(episode, "tool", 0) == [1.0] and rewards(episode, "plan", 0) == [2.0]

    problem = SudokuToolPlanEnv.problems("train", 1, holes=8)[0]
    sudoku = SudokuToolPlanEnv()
    sudoku.reset(options={"problem": problem})
    grid = [[0 if ch == "." else int(ch) for ch in row] for row in problem["puzzle"]]
    solution = [[int(ch) for ch in row] for row in problem["solution"]]
    generate = ScriptedGenerate({"tool": [[fenced(SUDOKU_SOLVER.format(grid=grid))]], "plan": [[f"#### {solution}"]]})
    episode = make_episode(sudoku, AGENTS, generate, k=1)
    asyncio.run(workflow(tool=SudokuTool, plan=SudokuPlan).run(episode))
    assert rewards(episode, "tool", 0) == [1.0] and rewards(episode, "plan", 0) == [2.0]
    assert episode.env.success()


def test_the_plan_answer_is_the_list_after_the_last_marker() -> None:
    plan = PlanPathPlan()
    assert plan.parse("<think>#### ['L']</think>Down twice, then right.\n#### ['d', 'd']\n#### ['u', 'r']") == [
        "U",
        "R",
    ]
    assert plan.parse("####[]") == []
    for text in ("no marker: ['U']", "#### go up", "#### ['UP']", "<think>\n#### ['U']", "x #### ['U']"):
        with pytest.raises(ParseError):
            plan.parse(text)
    assert SudokuPlan().parse("#### [[1, 2], [2, 1]]") == [[1, 2], [2, 1]]
    with pytest.raises(ParseError, match="square grid"):
        SudokuPlan().parse("#### [1, 2, 3, 4]")
    with pytest.raises(ParseError, match="code block"):
        PlanPathTool().parse("print('**Actions List**:', ['U'])")


def test_the_tool_alone_plays_the_actions_its_program_prints() -> None:
    env = PlanPathToolAloneEnv()
    env.reset(options={"problem": DETOUR})
    env.tool_limits = SHORT
    stuck = ["D", "R", "R", "U", "U"]  # blocked at the 2nd move; from where it stops, it would solve
    generate = ScriptedGenerate({"tool": [[printing(["D", "D"]), printing(stuck), bfs(DETOUR)]]})
    episode = make_episode(env, ("tool",), generate, k=3)
    alone = resolve("tool_plan", WORKFLOWS, "workflow")({"tool": PlanPathToolAlone()}, max_turns=2)
    assert alone.agents == ("tool",)
    asyncio.run(alone.run(episode))
    # the BFS path is applied: team term 1 + its own success 1; the others stop short: 0 + 0 (scored from
    # the state they acted on, not from where they left the walker)
    assert rewards(episode, "tool", 0) == [0.0, 0.0, 2.0]
    assert episode.env.success() and episode.finish()["turns"] == 1
    assert generate.calls == [("tool", 3)]
    assert "the action list your program prints is applied" in prompt_text(episode, "tool", 0)


def test_the_plan_alone_sees_no_program_and_its_answer_is_applied() -> None:
    env = PlanPathPlanAloneEnv()
    env.reset(options={"problem": DETOUR})
    generate = ScriptedGenerate({"plan": [['#### ["D"]'], [f"#### {SOLVE[1:]}"]]})
    episode = make_episode(env, ("plan",), generate, k=1)
    asyncio.run(resolve("tool_plan", WORKFLOWS, "workflow")({"plan": PlanPathPlanAlone()}, max_turns=2).run(episode))
    assert rewards(episode, "plan", 0) == [0.0] and rewards(episode, "plan", 1) == [2.0]
    second = prompt_text(episode, "plan", 1)
    assert "Plan Agent's Action: ['D']" in second and "Tool Agent's Code" not in second
    assert "tool agent's code" not in second and "You solve a planning problem alone" in second
    assert episode.env.success()
    with pytest.raises(ValueError, match="agents are plan"):
        env.action_examples("tool")
