"""The games' reference policies on hand-made grids and on generated problems: toward_goal and optimal
play what they say, the constants and random play only legal moves, the solvers solve, and the tool +
plan team's baselines equal the movers' on the same problems."""

from __future__ import annotations

import asyncio
import random

import pytest

from envs.check import EnvCheckError, check_env
from envs.plan_path import PlanPathEnv, team_moves
from envs.plan_path_solo import PlanPathSoloEnv
from envs.sokoban import SokobanEnv
from envs.sokoban_solo import SokobanSoloEnv
from envs.sudoku import SudokuEnv
from envs.sudoku_solo import SudokuSoloEnv
from envs.tool_plan import PlanPathToolPlanEnv
from mas_async.rollout.baseline import BaselineEpisode
from nodes.plan_path import HorizontalMover, PlanPathWorkflow, VerticalMover
from nodes.tool_plan import PlanPathPlan, PlanPathTool, ToolPlanWorkflow

POLICIES = PlanPathEnv.reference_policies()


def grid(rows: int, cols: int, walls: list, start: list, goal: list) -> PlanPathEnv:
    env = PlanPathEnv()
    env.reset(options={"problem": {"seed": -1, "rows": rows, "cols": cols, "walls": walls, "start": start,
                                   "goal": goal}})  # fmt: skip
    return env


def moves(name: str, env, agent: str, draws: int = 40) -> set:
    """Every move policy `name` plays for `agent` in `env`'s state over `draws` seeds."""
    policy = type(env).reference_policies()[name]
    return {policy(env, agent, random.Random(seed)) for seed in range(draws)}


def test_plan_path_names() -> None:
    assert list(POLICIES) == [
        "random", "always_U_L", "always_U_R", "always_D_L", "always_D_R", "toward_goal", "optimal",
    ]  # fmt: skip


def test_toward_goal_moves_on_its_own_axis_toward_the_goal() -> None:
    # . . .
    # A . .      goal two rows down and two columns right
    # . . G
    env = grid(3, 3, [], [1, 0], [2, 2])
    assert moves("toward_goal", env, "vertical") == {"D"} and moves("toward_goal", env, "horizontal") == {"R"}
    # Aligned on its axis: a move that is not blocked. Here row 1 of 3: up or down, both free.
    env = grid(3, 3, [], [1, 0], [1, 2])
    assert moves("toward_goal", env, "vertical") == {"U", "D"}
    # Aligned on the top row: up is off the grid, so down.
    env = grid(3, 3, [], [0, 0], [0, 2])
    assert moves("toward_goal", env, "vertical") == {"D"}
    # Aligned with a wall below and the edge above: both blocked, either one.
    env = grid(2, 3, [[1, 0]], [0, 0], [0, 2])
    assert moves("toward_goal", env, "vertical") == {"U", "D"}
    # Toward the goal even into a wall (the heuristic does not search).
    env = grid(3, 3, [[1, 1]], [0, 1], [2, 2])
    assert moves("toward_goal", env, "vertical") == {"D"}


def test_optimal_takes_the_detour_in_the_fewest_team_moves() -> None:
    # . # .      start top-left, goal top-right: 9 alternating moves (tests/unit/envs/test_plan_path.py)
    # . # .
    # . . .
    env = grid(3, 3, [[0, 1], [1, 1]], [0, 0], [0, 2])
    played = play_alternating(env, POLICIES["optimal"], random.Random(0))
    assert env.success() and len(played) == 9
    assert played[:2] == ["D", "R"] and played[2] == "D"  # down first: right is a wall


@pytest.mark.parametrize("name", ["optimal", "toward_goal", "random", "always_D_R"])
def test_every_move_is_legal_and_optimal_meets_team_moves(name: str) -> None:
    for problem in PlanPathEnv.problems("test", 24):
        env = PlanPathEnv()
        env.reset(options={"problem": problem})
        played = play_alternating(env, POLICIES[name], random.Random(problem["seed"]))
        assert all(m in "UDLR" for m in played)
        if name == "optimal":
            assert env.success() and len(played) == problem["team_moves"]


def play_alternating(env, policy, rng, limit: int = 40) -> list[str]:
    played = []
    for turn in range(limit):
        if env.done:
            break
        agent = env.possible_agents[turn % len(env.possible_agents)]
        played.append(policy(env, agent, rng))
        env.step(agent, played[-1])
    return played


def test_random_plays_both_moves_and_constants_are_constant() -> None:
    env = grid(3, 3, [], [1, 1], [2, 2])
    assert moves("random", env, "vertical") == {"U", "D"} and moves("random", env, "horizontal") == {"L", "R"}
    assert moves("always_U_R", env, "vertical") == {"U"} and moves("always_U_R", env, "horizontal") == {"R"}
    with pytest.raises(ValueError, match="plays vertical or horizontal, not 'solo'"):
        POLICIES["random"](env, "solo", random.Random(0))


def test_team_moves_with_the_horizontal_mover_first() -> None:
    # Two rows down, one column right: vertical first D, R, D (3); horizontal first R, D, L?... R, D, x, D.
    assert team_moves(3, 3, frozenset(), (0, 0), (2, 1)) == 3
    assert team_moves(3, 3, frozenset(), (0, 0), (2, 1), first=1) == 4


def test_the_solo_and_other_games_solvers_solve() -> None:
    for env_cls, name in ((PlanPathSoloEnv, "optimal"), (SokobanEnv, "optimal"),
                          (SokobanSoloEnv, "optimal"), (SudokuSoloEnv, "optimal"),
                          (SudokuSoloEnv, "fewest_candidates")):  # fmt: skip
        for problem in env_cls.problems("test", 6):
            env = env_cls()
            env.reset(options={"problem": problem})
            play_alternating(env, env_cls.reference_policies()[name], random.Random(0), limit=200)
            assert env.success(), (env_cls.__name__, name, problem["seed"])
    env = SudokuEnv()
    for problem in SudokuEnv.problems("test", 6):
        env.reset(options={"problem": problem})
        rng = random.Random(0)
        for _ in range(100):  # chooser then placer, as the workflow plays them
            if env.done:
                break
            env.step("chooser", SudokuEnv.reference_policies()["fewest_candidates"](env, "chooser", rng))
            env.step("placer", SudokuEnv.reference_policies()["fewest_candidates"](env, "placer", rng))
        assert env.success()


def test_sokoban_optimal_meets_team_moves() -> None:
    for problem in SokobanEnv.problems("test", 8):
        env = SokobanEnv()
        env.reset(options={"problem": problem})
        played = play_alternating(env, SokobanEnv.reference_policies()["optimal"], random.Random(0), limit=200)
        assert env.success() and len(played) == problem["team_moves"]


def _success(env_cls, nodes, workflow, name: str, problem: dict) -> bool:
    env = env_cls()
    env.reset(options={"problem": problem})
    episode = BaselineEpisode(
        name=name, policies=env_cls.reference_policies(), rng=random.Random(0), episode_id="b", problem_id="t",
        env=env, policy_of={a: a for a in nodes}, alpha=1.0,
    )  # fmt: skip
    asyncio.run(workflow.run(episode))
    return episode.finish()["success"]


def test_the_tool_plan_team_baselines_are_the_movers_on_the_same_problems() -> None:
    """One movers' turn per team turn: the deterministic baselines solve exactly the same problems."""
    movers = PlanPathWorkflow({"vertical": VerticalMover(), "horizontal": HorizontalMover()}, max_turns=3)
    team = ToolPlanWorkflow({"tool": PlanPathTool(), "plan": PlanPathPlan()}, max_turns=3)
    problems = PlanPathEnv.problems("test", 12, sizes=[4])
    for name in ("always_U_R", "toward_goal", "optimal"):
        solved = [_success(PlanPathEnv, movers.nodes, movers, name, p) for p in problems]
        assert [_success(PlanPathToolPlanEnv, team.nodes, team, name, p) for p in problems] == solved, name
    assert solved == [p["team_moves"] <= 6 for p in problems] and 0 < sum(solved) < 12  # optimal: the ceiling
    assert all(_success(PlanPathToolPlanEnv, team.nodes, team, "solver", p) for p in problems[:3])


def test_check_env_catches_a_reference_policy_that_plays_an_illegal_move() -> None:
    class Sloppy(SokobanEnv):
        @classmethod
        def reference_policies(cls):
            return {"stay": lambda env, agent, rng: "S"}

    class BadName(SokobanEnv):
        @classmethod
        def reference_policies(cls):
            return {"a/b": lambda env, agent, rng: "U"}

    with pytest.raises(EnvCheckError, match="reference policies: 'stay' played 'S' for 'vertical'"):
        check_env(Sloppy)
    with pytest.raises(EnvCheckError, match="name 'a/b' must be"):
        check_env(BadName)
    assert "reference policies" in check_env(SokobanEnv).checked


FIGURES = {  # env -> policy -> (problems solved, moves played) on the first 10 test problems, 12 moves each
    PlanPathEnv: {"random": (4, 95), "always_U_L": (0, 120), "always_U_R": (3, 98), "always_D_L": (0, 120),
                  "always_D_R": (2, 103), "toward_goal": (10, 58), "optimal": (10, 51)},
    PlanPathSoloEnv: {"random": (1, 112), "always_U": (0, 120), "always_D": (0, 120), "always_L": (0, 120),
                      "always_R": (0, 120), "toward_goal": (7, 63), "optimal": (10, 37)},
    SokobanEnv: {"random": (5, 87), "always_U_L": (1, 91), "always_U_R": (1, 100), "always_D_L": (0, 120),
                 "always_D_R": (0, 120), "optimal": (10, 45)},
    SokobanSoloEnv: {"random": (3, 106), "always_U": (1, 99), "always_D": (0, 120), "always_L": (1, 109),
                     "always_R": (1, 109), "optimal": (10, 28)},
    SudokuEnv: {"random": (0, 120), **{f"always_A_{d}": (0, 120) for d in range(1, 5)},
                "fewest_candidates": (10, 120), "optimal": (10, 120)},
    SudokuSoloEnv: {"random": (0, 120), **{f"always_A{d}": (0, 120) for d in range(1, 5)},
                    "fewest_candidates": (10, 60), "optimal": (10, 60)},
}  # fmt: skip


@pytest.mark.parametrize("env_cls", list(FIGURES), ids=lambda cls: cls.__name__)
def test_the_baselines_figures_on_fixed_problems_do_not_move(env_cls) -> None:
    """Each reference policy, in order, solves as many problems in as many moves as it did when the committed
    results were measured (each problem's rng seeded with its seed): a change to a policy, its tie-breaks or its
    draws from the rng moves these figures, and the baselines of every run with them."""
    problems = env_cls.problems("test", 10)
    figures = {}
    for name, policy in env_cls.reference_policies().items():
        solved = moves = 0
        for problem in problems:
            env = env_cls()
            env.reset(options={"problem": problem})
            moves += len(play_alternating(env, policy, random.Random(problem["seed"]), limit=12))
            solved += env.success()
        figures[name] = (solved, moves)
    assert figures == FIGURES[env_cls] and list(figures) == list(FIGURES[env_cls])
