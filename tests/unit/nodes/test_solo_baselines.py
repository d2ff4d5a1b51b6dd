"""The single-agent baselines of Sokoban, Sudoku, Code and Math: rules, parsing, rewards against
hand-computed cases (invalid and unparsable answers with the penalty, scored by a real `Episode`),
termination, observations and clone independence."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from envs.code import CodeEnv
from envs.code_data import load_own
from envs.code_solo import CodeSoloEnv
from envs.math_solo import MathSoloEnv
from envs.sokoban_solo import SokobanSoloEnv
from envs.sudoku_solo import SudokuSoloEnv
from mas_async.api import ParseError
from mas_async.rollout.chat_prompt import chat_prompt_ids
from mas_async.tiny_model import CHARACTERS, PRESETS, build_tokenizer
from nodes.solo import (
    ChatSoloPlacer,
    ChatSoloPusher,
    CodeSoloWorkflow,
    MathSoloWorkflow,
    SokobanSoloWorkflow,
    SoloCoder,
    SoloPlacer,
    SoloPusher,
    SoloReasoner,
    SudokuSoloWorkflow,
)
from tests.support.chat_fakes import ScriptedGenerate, make_episode
from tests.unit.envs.test_code_env import FULL, PARTIAL
from tests.unit.envs.test_math_env import HALF
from tests.unit.envs.test_sokoban import CORNER, CORRIDOR
from tests.unit.envs.test_sudoku import PUZZLE


def _reset(env_cls: type, problem: dict) -> Any:
    env = env_cls()
    env.reset(options={"problem": problem})
    return env


def _one_group(env: Any, workflow_cls: type, node: Any, texts: list[str], **options: Any) -> list:
    """Run the workflow for one step of K = len(texts) scripted candidates; (reward, valid) of each."""
    generate = ScriptedGenerate({"solo": [texts]})
    episode = make_episode(env, ("solo",), generate, k=len(texts))
    asyncio.run(workflow_cls({"solo": node}, **options).run(episode))
    assert generate.calls == [("solo", len(texts))]
    return [(s.reward, s.valid) for s in episode.samples]


# -- Sokoban ----------------------------------------------------------------------------------------


def test_sokoban_free_moves_and_progress_rewards() -> None:
    # ######
    # #A.BT#   two free moves (R, then the push R); the alternating team needs 4
    # #....#
    # ######
    env, node = _reset(SokobanSoloEnv, CORRIDOR), SoloPusher()
    assert env.distance() == 2 and env.observe("solo") == "S\n######\n#A.BT#\n#....#\n######\nA=1,1 B=1,3 T=1,4"
    after = env.clone()
    after.step("solo", "D")  # a detour: from (2,1) it takes R, U, then the push: 3
    assert after.distance() == 3 and node.local_reward(env, "D", after) == -1.0
    after = env.clone()
    after.step("solo", "U")  # into the wall: no progress, and no penalty (as for the team's bumps)
    assert after.infos == {"solo": {"blocked": True, "deadlock": False}} and node.local_reward(env, "U", after) == 0.0
    after = env.clone()
    after.step("solo", "R")
    assert node.local_reward(env, "R", after) == 1.0 and env.state == ((1, 1), ((1, 3),))  # original untouched
    solved = after.clone()
    solved.step("solo", "R")
    assert node.local_reward(after, "R", solved) == 1.0 and solved.team_reward() == 1.0
    assert solved.done and solved.terminations == {"solo": True} and solved.success()


def test_sokoban_deadlock_is_penalised() -> None:
    # #####
    # #...#    free solution: L, U, push R, U, R, push D = 6 moves; pushing the box up puts it against
    # #.B.#    the top wall, away from its target in the bottom row: a deadlock, which ends the episode
    # #.AT#
    # #####
    env, node = _reset(SokobanSoloEnv, CORNER), SoloPusher()
    assert env.distance() == 6
    after = env.clone()
    after.step("solo", "U")
    assert after.infos == {"solo": {"blocked": False, "deadlock": True}} and after.terminations == {"solo": True}
    assert after.distance() is None and node.local_reward(env, "U", after) == node.invalid_penalty


def test_sokoban_episode_scores_unparsable_with_the_penalty() -> None:
    env = _reset(SokobanSoloEnv, CORRIDOR)
    scored = _one_group(env, SokobanSoloWorkflow, SoloPusher(), ["R", "U", "D", "S"], max_moves=1)
    assert scored == [(1.0, True), (0.0, True), (-1.0, True), (-1.0, False)]  # team reward 0 throughout


def test_sokoban_parse_and_errors() -> None:
    node, chat = SoloPusher(), ChatSoloPusher()
    assert [node.parse(t) for t in (" U\n", "D", "LL", "R")] == ["U", "D", "L", "R"]
    assert chat.parse("<think>U?</think>Push it: R") == "R"
    assert chat.prompt("S\n#")[0]["role"] == "system"
    for bad in ("S", "", "u"):
        with pytest.raises(ParseError):
            node.parse(bad)
    with pytest.raises(ParseError):
        chat.parse("<think>R</think>left")
    with pytest.raises(ValueError, match="only agent"):
        _reset(SokobanSoloEnv, CORRIDOR).step("vertical", "U")
    with pytest.raises(ValueError, match="U, D, L, R"):
        _reset(SokobanSoloEnv, CORRIDOR).step("solo", "S")
    with pytest.raises(ValueError, match="max_moves"):
        SokobanSoloWorkflow({"solo": node}, max_moves=0)


def test_sokoban_solo_needs_no_more_moves_than_the_team() -> None:
    for problem in SokobanSoloEnv.problems("train", 10, sizes=[5, 6], max_moves=12):
        assert _reset(SokobanSoloEnv, problem).distance() <= problem["team_moves"]


# -- Sudoku -----------------------------------------------------------------------------------------
# ABC4   (tests/unit/envs/test_sudoku.py) A may be 1 or 3 (2 candidates, the solution's is 1); B must be 2,
# D412   C must be 3 and D must be 3 (1 candidate each)
# 2143
# 4321


def test_sudoku_observation_shows_every_open_cell_as_the_placer_sees_it() -> None:
    env = _reset(SudokuSoloEnv, PUZZLE)
    assert env.observe("solo") == (
        "S\n1:ABC4\n2:D412\n3:2143\n4:4321\n"
        "AT=A ROW=ABC4 COL=AD24 BOX=ABD4\n"
        "AT=B ROW=ABC4 COL=B413 BOX=ABD4\n"
        "AT=C ROW=ABC4 COL=C142 BOX=C412\n"
        "AT=D ROW=D412 COL=AD24 BOX=ABD4"
    )
    env.step("solo", "B2")
    assert env.observe("solo").splitlines()[1] == "1:A2C4" and "AT=B" not in env.observe("solo")
    assert env.action_examples("solo") == [f"{label}{d}" for label in "ACD" for d in range(1, 5)]


@pytest.mark.parametrize(
    ("action", "reward", "info"),
    [
        ("B2", 1.0 + 1.0, {"invalid": False, "correct": True}),  # forced cell, its digit
        ("A1", 0.5 + 1.0, {"invalid": False, "correct": True}),  # 2 candidates, the solution's digit
        ("A3", 0.5 + 0.0, {"invalid": False, "correct": False}),  # a legal digit, not the solution's
        ("A4", 0.5 - 1.0, {"invalid": False, "correct": False}),  # 4 is already in the row
        ("Z1", -1.0, {"invalid": True, "correct": False}),  # no such cell: nothing is placed
    ],
)
def test_sudoku_rewards_hand_computed(action: str, reward: float, info: dict) -> None:
    env, node = _reset(SudokuSoloEnv, PUZZLE), SoloPlacer()
    after = env.clone()
    after.step("solo", node.parse(action))
    assert node.local_reward(env, action, after) == reward and after.infos == {"solo": info}
    assert env.grid[0][:3] == [0, 0, 0] and env.selected is None and after.selected is None


def test_sudoku_a_filled_cell_is_invalid_and_the_full_grid_ends_the_episode() -> None:
    env, node = _reset(SudokuSoloEnv, PUZZLE), SoloPlacer()
    env.step("solo", "B2")
    after = env.clone()
    after.step("solo", "B2")
    assert node.local_reward(env, "B2", after) == -1.0
    for action in ("C3", "D3", "A1"):
        assert not env.done and env.team_reward() == 0.0
        env.step("solo", action)
    assert env.done and env.terminations == {"solo": True} and env.success()


def test_sudoku_episode_scores_unparsable_with_the_penalty() -> None:
    env = _reset(SudokuSoloEnv, PUZZLE)
    scored = _one_group(env, SudokuSoloWorkflow, SoloPlacer(), ["B2", "A3", "Z1", "2B", "B"], max_moves=1)
    assert scored == [(2.0, True), (0.5, True), (-1.0, True), (-1.0, False), (-1.0, False)]


def test_sudoku_parse_and_errors() -> None:
    node, chat = SoloPlacer(), ChatSoloPlacer()
    assert [node.parse(t) for t in ("B3", " A1\n", "C42")] == ["B3", "A1", "C4"]
    for bad in ("3B", "B", "B 3", "b3", ""):
        with pytest.raises(ParseError, match="like B3"):
            node.parse(bad)
    assert chat.parse("<think>A1</think>Row 1 needs a 2, so B2.") == "B2"
    with pytest.raises(ParseError):
        chat.parse("B 2")
    for bad in ("B", "BB", "B33", ["B", "3"]):
        with pytest.raises(ValueError, match="like 'B3'"):
            _reset(SudokuSoloEnv, PUZZLE).step("solo", bad)
    with pytest.raises(ValueError, match="only agent"):
        _reset(SudokuSoloEnv, PUZZLE).observe("chooser")


def test_sudoku_tiny_config_prompts_fit_the_tiny_model() -> None:
    tokenizer = build_tokenizer()
    for problem in SudokuSoloEnv.problems("train", 10, sizes=[4, 9], holes=4):
        obs = _reset(SudokuSoloEnv, problem).observe("solo")
        assert set(obs) <= set(CHARACTERS)
        ids = chat_prompt_ids(tokenizer, SoloPlacer().prompt(obs))
        assert len(ids) + 2 < PRESETS["tiny-char"].max_position_embeddings


# -- Code -------------------------------------------------------------------------------------------


def test_code_rewards_are_the_ground_truth_pass_ratio_and_a_full_pass_ends() -> None:
    problem, node = load_own()[0], SoloCoder()  # sum_of_squares, 4 hidden tests
    env = _reset(CodeSoloEnv, problem)
    after = env.clone()
    after.step("solo", node.parse(PARTIAL))  # passes 3 of the 4
    assert node.local_reward(env, None, after) == after.team_reward() == 0.75
    assert not after.done and env.code is None  # the original is untouched
    assert "CURRENT CODE" in after.observe("solo") and "RESULT" not in after.observe("solo")
    assert after.observe("solo") == CodeEnv.observe(after, "coder")
    solved = after.clone()
    solved.step("solo", node.parse(FULL))
    assert node.local_reward(after, None, solved) == 1.0 and solved.terminations == {"solo": True}
    assert solved.infos == {"solo": {"pass_ratio": 1.0, "test_agreement": 0.0}} and not after.done


def test_code_episode_scores_unparsable_with_the_penalty() -> None:
    env = _reset(CodeSoloEnv, load_own()[0])
    scored = _one_group(env, CodeSoloWorkflow, SoloCoder(), [PARTIAL, "I cannot code", FULL], max_turns=2)
    assert scored == [(1.5, True), (-1.0, False), (2.0, True)]  # then solved: no second turn
    assert "tester" not in SoloCoder().prompt("x")[0]["content"]


# -- Math -------------------------------------------------------------------------------------------


def test_math_rewards_and_a_repeated_answer_ends_the_episode() -> None:
    env, node = _reset(MathSoloEnv, HALF), SoloReasoner()
    after = env.clone()
    after.step("solo", node.parse("1 - 1/2 = \\boxed{\\frac{1}{2}}"))
    assert node.local_reward(env, None, after) == after.team_reward() == 1.0
    assert after.infos == {"solo": {"correct": True}} and not after.done and env.reasoner_answer is None
    assert "REASONER ANSWER: \\frac{1}{2}" in after.observe("solo")
    wrong = after.clone()
    wrong.step("solo", node.parse("\\boxed{2}"))
    assert node.local_reward(after, None, wrong) == wrong.team_reward() == 0.0 and not wrong.done
    again = after.clone()
    again.step("solo", node.parse("\\boxed{0.5}"))  # the same answer (math-verify): the end
    assert again.terminations == {"solo": True} and again.success() and not after.done


def test_math_episode_scores_unparsable_with_the_penalty() -> None:
    env = _reset(MathSoloEnv, HALF)
    generate = ScriptedGenerate({"solo": [["\\boxed{2}", "\\boxed{1/2}", "no answer"], ["\\boxed{0.5}"] * 3]})
    episode = make_episode(env, ("solo",), generate, k=3)
    asyncio.run(MathSoloWorkflow({"solo": SoloReasoner()}, max_turns=4).run(episode))
    assert generate.calls == [("solo", 3), ("solo", 3)]  # the answer repeated at the second turn: the end
    assert [(s.reward, s.valid) for s in episode.samples[:3]] == [(0.0, True), (2.0, True), (-1.0, False)]
    assert episode.env.done and episode.finish()["success"] is True
    assert "tool" not in SoloReasoner().prompt("x")[0]["content"]


# -- every baseline ---------------------------------------------------------------------------------

PROBLEMS = {
    SokobanSoloEnv: CORRIDOR,
    SudokuSoloEnv: PUZZLE,
    CodeSoloEnv: load_own()[0],
    MathSoloEnv: HALF,
}


@pytest.mark.parametrize("env_cls", list(PROBLEMS), ids=lambda cls: cls.__name__)
def test_clones_are_independent(env_cls: type) -> None:
    env = _reset(env_cls, PROBLEMS[env_cls])
    first, second = env.action_examples("solo")[:2]
    obs, infos = env.observe("solo"), dict(env.infos)
    clone = env.clone()
    clone.step("solo", first)
    assert env.observe("solo") == obs and env.infos == infos and not env.done  # the clone moved alone
    stepped = clone.observe("solo")
    env.step("solo", second)
    assert clone.observe("solo") == stepped and clone.infos is not env.infos
    assert env.possible_agents == ["solo"] and set(env.terminations) == set(env.truncations) == {"solo"}
