"""Plan-Path env, its nodes and workflow: grid rules, problem generation, rewards and observations."""

from __future__ import annotations

import pytest

from envs import ENVS
from envs.plan_path import PlanPathEnv, bfs_distances, shortest_path_length, team_moves
from mas_async.api import Env, ParseError, resolve
from nodes import NODES, WORKFLOWS
from nodes.plan_path import HorizontalMover, PlanPathWorkflow, VerticalMover

ALLOWED = set("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ \n.#:,=-")

# . # .
# . # .
# . . .      start top-left, goal top-right: the wall forces a detour of 6 moves (9 for the team:
#            D, R blocked, D, R, U blocked, R, U, R blocked, U)
DETOUR = {
    "seed": -1,
    "rows": 3,
    "cols": 3,
    "walls": [[0, 1], [1, 1]],
    "start": [0, 0],
    "goal": [0, 2],
    "shortest": 6,
    "team_moves": 9,
}


def make_env(problem: dict) -> PlanPathEnv:
    env = PlanPathEnv()
    env.reset(options={"problem": problem})
    return env


def test_bfs_shortest_path_on_hand_built_grids() -> None:
    walls = frozenset({(0, 1), (1, 1)})
    assert shortest_path_length(3, 3, walls, (0, 0), (0, 2)) == 6
    assert shortest_path_length(3, 3, frozenset(), (0, 0), (2, 2)) == 4
    assert shortest_path_length(3, 3, frozenset({(0, 1), (1, 1), (2, 1)}), (0, 0), (0, 2)) is None
    dist = bfs_distances(3, 3, walls, (0, 2))
    assert dist[(0, 2)] == 0 and dist[(2, 1)] == 3 and dist[(2, 0)] == 4 and dist[(0, 0)] == 6
    assert (0, 1) not in dist and (1, 1) not in dist


def test_team_moves_on_an_open_grid() -> None:
    # D, R, D, R: the alternation costs nothing when both axes need the same number of moves.
    assert team_moves(3, 3, frozenset(), (0, 0), (2, 2)) == 4
    assert team_moves(3, 3, frozenset(), (1, 1), (1, 1)) == 0
    # One row: every vertical move is blocked by the edges, so the horizontal mover moves every other turn.
    assert team_moves(1, 3, frozenset(), (0, 0), (0, 2)) == 4


def test_team_moves_waits_on_a_blocked_move() -> None:
    # One row down and two columns right: three moves on the grid, but V, H, V must change the column
    # only once, so the team needs V, H, V, H with one vertical move wasted: U off the top edge.
    assert shortest_path_length(3, 3, frozenset(), (0, 0), (1, 2)) == 3
    assert team_moves(3, 3, frozenset(), (0, 0), (1, 2)) == 4
    # . # .
    # A . G      the middle cell sits between two walls, so the vertical mover can only wait there
    # . # .      (U and D are blocked); reaching the middle on the horizontal mover's turn takes a detour:
    # U, R (blocked by the wall), D, R, U (blocked), R.
    walls = frozenset({(0, 1), (2, 1)})
    assert shortest_path_length(3, 3, walls, (1, 0), (1, 2)) == 2
    assert team_moves(3, 3, walls, (1, 0), (1, 2)) == 6
    walls = frozenset(tuple(w) for w in DETOUR["walls"])
    assert team_moves(3, 3, walls, (0, 0), (0, 2)) == DETOUR["team_moves"] == 9


def test_team_moves_unreachable_goal() -> None:
    walls = frozenset({(0, 1), (1, 1), (2, 1)})
    assert shortest_path_length(3, 3, walls, (0, 0), (0, 2)) is None
    assert team_moves(3, 3, walls, (0, 0), (0, 2)) is None
    # A goal walled in on all four sides.
    walls = frozenset({(0, 1), (1, 0), (1, 2), (2, 1)})
    assert team_moves(3, 3, walls, (0, 0), (1, 1)) is None


def test_distance_follows_the_token() -> None:
    env = make_env(DETOUR)
    assert env.distance() == 6
    env.step("vertical", "D")
    assert env.position == (1, 0) and env.distance() == 5


def test_problems_are_deterministic_from_seed() -> None:
    assert PlanPathEnv.problems("train", 5) == PlanPathEnv.problems("train", 5)
    assert PlanPathEnv.problems("train", 3, first=2) == PlanPathEnv.problems("train", 5)[2:]
    assert PlanPathEnv.problems("test", 4) == PlanPathEnv.problems("test", 4)
    assert PlanPathEnv.problems("train", 5) != PlanPathEnv.problems("test", 5)


def test_train_and_test_seeds_are_disjoint() -> None:
    train = {p["seed"] for p in PlanPathEnv.problems("train", 50)}
    test = {p["seed"] for p in PlanPathEnv.problems("test", 50)}
    assert train == set(range(50)) and not train & test and min(test) >= 10**9


@pytest.mark.parametrize("split", ["train", "test"])
def test_every_generated_problem_is_team_solvable_and_needs_both_agents(split: str) -> None:
    for problem in PlanPathEnv.problems(split, 60):
        walls = frozenset(tuple(w) for w in problem["walls"])
        start, goal = tuple(problem["start"]), tuple(problem["goal"])
        assert problem["rows"] in (4, 5) and problem["cols"] in (4, 5)
        assert start not in walls and goal not in walls
        assert start[0] != goal[0] and start[1] != goal[1]
        assert shortest_path_length(problem["rows"], problem["cols"], walls, start, goal) == problem["shortest"]
        assert problem["shortest"] >= 2
        team = team_moves(problem["rows"], problem["cols"], walls, start, goal)
        assert team is not None and problem["team_moves"] == team >= problem["shortest"]


def test_problem_options_and_mistakes() -> None:
    for problem in PlanPathEnv.problems("train", 10, sizes=[6], density=0.0):
        assert (problem["rows"], problem["cols"]) == (6, 6) and problem["walls"] == []
    with pytest.raises(ValueError, match="split"):
        PlanPathEnv.problems("valid", 3)
    with pytest.raises(ValueError, match="density"):
        PlanPathEnv.problems("train", 3, density=1.5)
    with pytest.raises(ValueError, match="sizes"):
        PlanPathEnv.problems("train", 3, sizes=[1])
    with pytest.raises(ValueError, match="start"):
        make_env({**DETOUR, "start": [0, 1]})


def test_blocked_moves_leave_the_token_and_are_recorded() -> None:
    env = make_env(DETOUR)
    env.step("vertical", "U")  # off the grid
    assert env.position == (0, 0) and env.infos["vertical"]["blocked"]
    env.step("horizontal", "R")  # into the wall
    assert env.position == (0, 0) and env.infos["horizontal"]["blocked"]
    env.step("horizontal", "S")
    assert env.position == (0, 0) and not env.infos["horizontal"]["blocked"]
    env.step("vertical", "D")
    assert env.position == (1, 0) and not env.infos["vertical"]["blocked"]
    with pytest.raises(ValueError, match="cannot play"):
        env.step("vertical", "L")


def test_reaching_the_goal_terminates_with_team_reward_one() -> None:
    env = make_env(
        {
            "seed": -2,
            "rows": 2,
            "cols": 2,
            "walls": [],
            "start": [0, 0],
            "goal": [1, 1],
            "shortest": 2,
            "team_moves": 2,
        }
    )
    env.step("vertical", "D")
    assert env.team_reward() == 0.0 and not any(env.terminations.values()) and not env.success()
    env.step("horizontal", "R")
    assert env.team_reward() == 1.0 and all(env.terminations.values()) and env.success()
    assert not any(env.truncations.values()) and env.done


def test_clone_is_independent() -> None:
    env = make_env(DETOUR)
    copy = env.clone()
    copy.step("vertical", "D")
    copy.step("horizontal", "R")  # into the wall at (1, 1): blocked
    assert env.position == (0, 0) and copy.position == (1, 0)
    assert not env.infos["horizontal"]["blocked"] and copy.infos["horizontal"]["blocked"]
    env.step("vertical", "D")
    env.step("vertical", "D")
    assert copy.position == (1, 0) and env.position == (2, 0)


def test_local_rewards_hand_computed() -> None:
    vertical, horizontal = VerticalMover(), HorizontalMover()
    cases = [
        ("vertical", "D", 1.0),  # along the detour: 6 -> 5
        ("vertical", "S", 0.0),  # the env's stay, which no node plays: no progress
        ("vertical", "U", -1.0),  # off the grid: blocked
        ("horizontal", "R", -1.0),  # into the wall: blocked
        ("horizontal", "L", -1.0),  # off the grid: blocked
    ]
    for agent, action, expected in cases:
        before = make_env(DETOUR)
        after = before.clone()
        after.step(agent, action)
        node = vertical if agent == "vertical" else horizontal
        assert node.local_reward(before, action, after) == expected, (agent, action)
    # From (1, 0) moving up goes back away from the goal along the detour: 5 -> 6.
    before = make_env({**DETOUR, "start": [1, 0]})
    after = before.clone()
    after.step("vertical", "U")
    assert vertical.local_reward(before, "U", after) == -1.0


def test_observation_format_and_characters() -> None:
    env = make_env(DETOUR)
    assert env.observe("vertical") == "V\nA#G\n.#.\n...\nA=0,0 G=0,2"
    assert env.observe("horizontal").startswith("H\n")
    for problem in PlanPathEnv.problems("test", 20, sizes=[4, 5, 12]):
        env = make_env(problem)
        for agent in env.possible_agents:
            assert set(env.observe(agent)) <= ALLOWED


def test_parse_accepts_only_the_nodes_moves() -> None:
    vertical, horizontal = VerticalMover(), HorizontalMover()
    assert vertical.moves == ("U", "D") and horizontal.moves == ("L", "R")
    assert vertical.parse(" D\n") == "D" and vertical.parse("UUU") == "U"
    assert horizontal.parse("L because") == "L" and horizontal.parse("\tR") == "R"
    for text in ("", "   ", "R", "d", "XD"):
        with pytest.raises(ParseError):
            vertical.parse(text)
    for text in ("U", "D", "l", "XR"):
        with pytest.raises(ParseError):
            horizontal.parse(text)
    assert vertical.prompt("V\n.") == [{"role": "user", "content": "V\n."}]


def test_movers_reject_stay() -> None:
    # "S" is still an env action (see test_blocked_moves_leave_the_token_and_are_recorded), but no mover's.
    for node, moves in ((VerticalMover(), "U, D"), (HorizontalMover(), "L, R")):
        for text in ("S", " S\n", "SSS", "S then D"):
            with pytest.raises(ParseError, match=f"expected one of {moves} first"):
                node.parse(text)


def test_workflow_checks_its_nodes_and_options() -> None:
    nodes = {"vertical": VerticalMover(), "horizontal": HorizontalMover()}
    assert PlanPathWorkflow(nodes).max_turns == 8
    with pytest.raises(ValueError, match="horizontal"):
        PlanPathWorkflow({"vertical": VerticalMover()})
    with pytest.raises(ValueError, match="max_turns"):
        PlanPathWorkflow(nodes, max_turns=0)
    with pytest.raises(ValueError, match="plays"):
        PlanPathWorkflow({"vertical": HorizontalMover(), "horizontal": HorizontalMover()})


def test_registries_resolve() -> None:
    assert resolve("plan_path", ENVS, "env") is PlanPathEnv
    assert issubclass(PlanPathEnv, Env)
    assert resolve("plan_path_vertical", NODES, "node") is VerticalMover
    assert resolve("plan_path_horizontal", NODES, "node") is HorizontalMover
    assert resolve("plan_path", WORKFLOWS, "workflow") is PlanPathWorkflow


def test_chat_movers_for_real_models():
    from nodes.plan_path import ChatHorizontalMover, ChatVerticalMover

    vertical, horizontal = ChatVerticalMover(), ChatHorizontalMover()
    messages = vertical.prompt("V\nA.\n.G\nA=0,0 G=1,1")
    assert messages[0]["role"] == "system" and "down (D)" in messages[0]["content"]
    assert "right (R)" in messages[0]["content"] and messages[1]["content"].startswith("V")
    assert vertical.parse("<think>Maybe U? No.</think>The goal is below me, so: D") == "D"
    assert horizontal.parse("I move R") == "R"
    with pytest.raises(ParseError):
        vertical.parse("<think>D</think>I would go left")  # thinking does not count
