"""Macro actions by hand: a list of moves (Plan-Path, Sokoban) applied in order, stopping at the goal or at
the first blocked move, and a complete Sudoku grid; the tool + plan envs (`envs/tool_plan.py`) built on them."""

from __future__ import annotations

import pytest

from envs.plan_path import PlanPathEnv
from envs.sokoban import SokobanEnv
from envs.sudoku import SudokuEnv
from envs.tool_plan import (
    PlanPathToolPlanEnv,
    SokobanToolPlanEnv,
    SudokuToolPlanEnv,
    as_grid,
    as_moves,
    literal_list,
    printed_list,
)
from mas_async.api import Env, Limits

# . # G      start top-left, goal top-right: the wall forces a detour D, D, R, R, U, U
# . # .
# . . .
DETOUR = {"seed": -1, "rows": 3, "cols": 3, "walls": [[0, 1], [1, 1]], "start": [0, 0], "goal": [0, 2]}
SOLVE = ["D", "D", "R", "R", "U", "U"]

# #####
# #.T.#      the keeper A under the box B under the target T: one push up solves it
# #.B.#
# #.A.#
# #####
BORDER = [[r, c] for r in range(5) for c in range(5) if r in (0, 4) or c in (0, 4)]
PUSH = {"seed": -1, "rows": 5, "cols": 5, "walls": BORDER, "targets": [[1, 2]], "boxes": [[2, 2]], "player": [3, 2]}


def reset(env: Env, problem: dict) -> Env:
    env.reset(options={"problem": problem})
    return env


def test_plan_path_macro_reaches_the_goal_and_stops_there() -> None:
    env = reset(PlanPathToolPlanEnv(), DETOUR)
    env.step("plan", [*SOLVE, "L", "L"])  # the moves after the goal are not applied
    assert env.position == (0, 2) and env.success() and env.done
    assert env.team_reward() == 1.0
    assert env.infos["plan"] == {"blocked": False, "moves": 6, "solved": True}


def test_plan_path_macro_stops_at_the_first_blocked_move() -> None:
    env = reset(PlanPathToolPlanEnv(), DETOUR)
    env.step("plan", ["D", "R", "D"])  # (1, 0), then R into the wall at (1, 1): the last D is not applied
    assert env.position == (1, 0) and not env.done and env.team_reward() == 0.0
    assert env.infos["plan"] == {"blocked": True, "moves": 1, "solved": False}
    env = reset(PlanPathToolPlanEnv(), DETOUR)
    env.step("plan", ["U"])  # off the grid at once
    assert env.position == (0, 0) and env.infos["plan"]["moves"] == 0 and env.infos["plan"]["blocked"]


def test_a_macro_with_an_unknown_move_changes_nothing() -> None:
    env = reset(PlanPathToolPlanEnv(), DETOUR)
    with pytest.raises(ValueError, match="cannot play 'X'"):
        env.step("plan", ["D", "X"])
    assert env.position == (0, 0) and env.turns == ()
    movers = reset(PlanPathEnv(), DETOUR)
    with pytest.raises(ValueError, match="cannot play 'R'"):
        movers.step("vertical", ["D", "R"])  # a mover's macro holds only its own moves
    assert movers.position == (0, 0)


def test_the_movers_play_macros_of_their_own_moves() -> None:
    env = reset(PlanPathEnv(), DETOUR)
    env.step("vertical", ["D", "D", "D"])  # the third is off the grid
    assert env.position == (2, 0) and env.infos["vertical"] == {"blocked": True, "moves": 2}
    env.step("horizontal", ["R", "R"])
    assert env.position == (2, 2) and env.infos["horizontal"] == {"blocked": False, "moves": 2}
    env.step("vertical", ["U", "U"])
    assert env.success() and env.done


def test_sokoban_macro_pushes_stops_when_solved_and_at_a_bump() -> None:
    env = reset(SokobanToolPlanEnv(), PUSH)
    env.step("plan", ["R", "R", "U"])  # (3, 3), then the wall at (3, 4): stop there
    assert env.state[0] == (3, 3) and env.infos["plan"] == {"blocked": True, "moves": 1, "solved": False}
    env = reset(SokobanToolPlanEnv(), PUSH)
    env.step("plan", ["U", "D", "D"])  # the push solves the level; the rest is not applied
    assert env.state == ((2, 2), ((1, 2),)) and env.success() and env.done and env.team_reward() == 1.0
    assert env.infos["plan"] == {"blocked": False, "moves": 1, "solved": True}
    movers = reset(SokobanEnv(), PUSH)
    movers.step("horizontal", ["L", "L"])  # (3, 1), then the wall
    assert movers.state[0] == (3, 1) and movers.infos["horizontal"]["moves"] == 1
    assert movers.infos["horizontal"]["blocked"]


def test_sudoku_macro_is_a_complete_grid_written_only_when_right() -> None:
    problem = SudokuEnv.problems("train", 1, holes=6)[0]
    solution = [[int(d) for d in row] for row in problem["solution"]]
    env = reset(SudokuToolPlanEnv(), problem)
    wrong = [row[:] for row in solution]
    wrong[0][0], wrong[0][1] = wrong[0][1], wrong[0][0]
    before = [row[:] for row in env.grid]
    for bad in (wrong, [[1]], [[1, 2], [2, 1]]):  # wrong digits, wrong sizes: nothing is written
        env.step("plan", bad)
        assert env.grid == before and not env.done and env.infos["plan"] == {"solved": False}
    with pytest.raises(ValueError, match="list of rows of integers"):
        env.step("plan", ["1234", "3412", "2143", "4321"])
    env.step("plan", solution)
    assert env.grid == solution and env.done and env.team_reward() == 1.0
    base = reset(SudokuEnv(), problem)
    assert base.fill_grid(solution) and base.filled() and base.done


def test_reading_printed_actions_never_evaluates_code() -> None:
    assert printed_list('searching...\n**Actions List**: ["U", "R"] done') == ["U", "R"]
    assert printed_list("**Actions List**: [[1, 2], [2, 1]]\n") == [[1, 2], [2, 1]]
    assert printed_list("path found\n['D', 'L']\n") == ["D", "L"]  # the reference's fallback: a bare list line
    assert printed_list("no list here") is None
    assert literal_list("[__import__('os').getcwd()]") is None
    assert as_moves(["u", " R "]) == ["U", "R"] and as_moves(["UP"]) is None and as_moves("UR") is None
    assert as_grid([[1, 2], [2, 1]]) == [[1, 2], [2, 1]] and as_grid([[1, 2]]) is None and as_grid([[True]]) is None


def test_the_tool_step_runs_the_program_and_records_what_it_printed() -> None:
    env = reset(PlanPathToolPlanEnv(), DETOUR)
    env.step("tool", {"code": f"print('**Actions List**:', {SOLVE!r})"})
    assert env.position == (0, 0) and not env.done  # the tool's actions are not applied
    assert env.infos["tool"] == {"status": "ok", "parsed": True, "actions": SOLVE}
    assert env.tool_actions == SOLVE and env.achieves(SOLVE) and not env.achieves(SOLVE[:3])
    assert f"Here are the actions it printed: {SOLVE}" in env.observe("plan")
    assert "Here is the tool agent's code" not in env.observe("tool")
    env.step("plan", SOLVE[:2])
    assert env.tool_actions is None
    history = env.observe("tool")
    assert "--- Turn 1 ---" in history and f"Plan Agent's Action: {SOLVE[:2]}" in history


def test_a_failing_or_hanging_tool_program_parses_nothing() -> None:
    env = reset(PlanPathToolPlanEnv(), DETOUR)
    env.tool_limits = Limits(timeout_s=1.0, cpu_s=1)
    env.step("tool", {"code": "raise SystemExit(3)"})
    assert env.infos["tool"] == {"status": "error", "parsed": False, "actions": None} and env.tool_actions is None
    env.step("tool", {"code": "while True:\n    pass\n"})
    assert env.infos["tool"] == {"status": "timeout", "parsed": False, "actions": None}
    assert "[timeout" in env.observe("plan")
