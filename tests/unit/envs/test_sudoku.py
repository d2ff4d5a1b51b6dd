"""Sudoku env, its chooser and placer and workflow: uniqueness, rules, rewards, observations and clones."""

from __future__ import annotations

import asyncio
import json

import pytest

from envs.sudoku import BOX, SudokuEnv, count_solutions, solved_grid
from mas_async.api import ParseError
from nodes.sudoku import CellChooser, ChatCellChooser, ChatDigitPlacer, DigitPlacer, SudokuWorkflow
from tests.unit.envs.test_sokoban import ALLOWED, episode

SOLUTION = ["1234", "3412", "2143", "4321"]
# ABC4      the empty cells are labelled A, B, C, D in reading order. A may be 1 or 3 as far as its row,
# D412      column and box tell (2 candidates); B must be 2, C must be 3 and D must be 3 (1 each).
# 2143      Unique: with D = 3 the first column forces A = 1.
# 4321
PUZZLE = {"seed": -1, "size": 4, "puzzle": ["...4", ".412", "2143", "4321"], "solution": SOLUTION, "holes": 4}


def make_env(problem: dict) -> SudokuEnv:
    env = SudokuEnv()
    env.reset(options={"problem": problem})
    return env


def grid(rows: list[str]) -> list[list[int]]:
    return [[0 if ch == "." else int(ch) for ch in row] for row in rows]


def is_valid_solution(rows: list[list[int]]) -> bool:
    n, b = len(rows), BOX[len(rows)]
    digits = set(range(1, n + 1))
    boxes = [
        [rows[r][c] for r in range(i, i + b) for c in range(j, j + b)] for i in range(0, n, b) for j in range(0, n, b)
    ]
    columns = [[rows[r][c] for r in range(n)] for c in range(n)]
    return all(set(group) == digits for group in [*rows, *columns, *boxes])


def test_count_solutions_on_hand_built_grids() -> None:
    assert count_solutions(grid(SOLUTION)) == 1
    assert count_solutions(grid(PUZZLE["puzzle"])) == 1
    assert count_solutions(grid(["...4", "...2", "2143", "4321"])) == 2  # the top-left box can be 13/.. or 31/..
    assert count_solutions(grid(["....", "....", "....", "...."])) == 2  # counting stops at the limit
    assert count_solutions(grid(["11..", "....", "....", "...."])) == 0  # two 1s in a row
    puzzle = grid(PUZZLE["puzzle"])
    count_solutions(puzzle)
    assert puzzle == grid(PUZZLE["puzzle"])  # the grid is restored


@pytest.mark.parametrize("size", [4, 9])
def test_generated_puzzles_have_a_unique_solution(size: int) -> None:
    import random

    assert is_valid_solution(solved_grid(size, random.Random(7)))
    holes = 6 if size == 4 else 26
    for split in ("train", "test"):
        for problem in SudokuEnv.problems(split, 15, sizes=[size], holes=holes):
            assert json.loads(json.dumps(problem)) == problem and problem["size"] == size
            solution, puzzle = grid(problem["solution"]), grid(problem["puzzle"])
            assert is_valid_solution(solution)
            assert sum(row.count(0) for row in puzzle) == holes
            assert all(puzzle[r][c] in (0, solution[r][c]) for r in range(size) for c in range(size))
            assert count_solutions(puzzle) == 1


def test_problems_are_deterministic_and_splits_disjoint() -> None:
    assert SudokuEnv.problems("train", 5, sizes=[4, 9]) == SudokuEnv.problems("train", 5, sizes=[4, 9])
    assert SudokuEnv.problems("train", 3, first=2) == SudokuEnv.problems("train", 5)[2:]
    train = {p["seed"] for p in SudokuEnv.problems("train", 30)}
    test = {p["seed"] for p in SudokuEnv.problems("test", 30)}
    assert train == set(range(30)) and not train & test
    assert {p["size"] for p in SudokuEnv.problems("train", 30, sizes=[4, 9])} == {4, 9}


def test_rules_of_a_turn() -> None:
    env = make_env(PUZZLE)
    assert env.cells == {"A": (0, 0), "B": (0, 1), "C": (0, 2), "D": (1, 0)}
    env.step("chooser", "D")  # row 2, column 1: open
    assert env.selected == (1, 0) and env.infos["chooser"] == {"invalid": False}
    env.step("placer", "1")  # wrong (it is 3): refused, the selection is cleared
    assert env.grid[1][0] == 0 and env.selected is None and env.infos["placer"] == {"correct": False}
    env.step("chooser", "E")  # labels no cell
    assert env.selected is None and env.infos["chooser"] == {"invalid": True}
    env.step("placer", "3")  # nothing selected: nothing written
    assert env.infos["placer"] == {"correct": False} and env.grid[1][0] == 0
    for label, digit in (("D", "3"), ("C", "3"), ("B", "2")):
        env.step("chooser", label)
        env.step("placer", digit)
        assert env.infos["placer"] == {"correct": True} and env.team_reward() == 0.0 and not env.done
    env.step("chooser", "D")  # filled now
    assert env.selected is None and env.infos["chooser"] == {"invalid": True}
    assert env.action_examples("chooser") == ["A"] and env.action_examples("placer") == []
    env.step("chooser", "A")
    env.step("placer", "1")
    assert env.team_reward() == 1.0 and env.success() and all(env.terminations.values())
    with pytest.raises(ValueError, match="over"):
        env.step("chooser", "A")
    with pytest.raises(ValueError, match="chooser plays"):
        make_env(PUZZLE).step("chooser", "11")


def test_local_rewards_hand_computed() -> None:
    chooser, placer = CellChooser(), DigitPlacer()
    start = make_env(PUZZLE)
    for label, expected in (("A", 0.5), ("B", 1.0), ("D", 1.0), ("E", -1.0), ("Z", -1.0)):
        after = start.clone()
        after.step("chooser", label)
        assert chooser.local_reward(start, label, after) == expected, label
    filled = start.clone()
    filled.step("chooser", "B")
    filled.step("placer", "2")
    after = filled.clone()
    after.step("chooser", "B")
    assert chooser.local_reward(filled, "B", after) == -1.0
    chosen = start.clone()
    chosen.step("chooser", "A")  # 1 or 3 by the rules; the solution's is 1
    for digit, expected in (("1", 1.0), ("3", 0.0), ("4", -1.0), ("9", -1.0)):
        after = chosen.clone()
        after.step("placer", digit)
        assert placer.local_reward(chosen, digit, after) == expected, digit
    unselected = start.clone()
    unselected.step("placer", "1")
    assert placer.local_reward(start, "1", unselected) == -1.0


def test_parse_and_unparsable_answers_get_the_penalty() -> None:
    assert CellChooser().parse(" B\n") == "B" and DigitPlacer().parse("4X") == "4"
    for text in ("", "2", "b", " .A"):
        with pytest.raises(ParseError):
            CellChooser().parse(text)
    for text in ("", "0", "X4"):
        with pytest.raises(ParseError):
            DigitPlacer().parse(text)
    assert ChatCellChooser().parse("<think>A</think>The easiest cell is D.") == "D"
    assert ChatDigitPlacer().parse("The digit is 3.") == "3"
    with pytest.raises(ParseError):
        ChatDigitPlacer().parse("<think>3</think>not sure")
    ep = episode(make_env(PUZZLE), ("chooser",), [["A", "1", "", "Z"]], k=4)
    asyncio.run(ep.act(CellChooser()))
    assert [s.reward for s in ep.samples] == [0.5, -1.0, -1.0, -1.0]
    assert [s.valid for s in ep.samples] == [True, False, False, True]


def test_workflow_skips_the_placer_after_an_invalid_choice_and_solves() -> None:
    nodes = {"chooser": CellChooser(), "placer": DigitPlacer()}
    replies = [["Z"], ["D"], ["3"], ["C"], ["3"], ["B"], ["2"], ["A"], ["1"]]
    ep = episode(make_env(PUZZLE), ("chooser", "placer"), replies, k=1)
    asyncio.run(SudokuWorkflow(nodes, max_turns=8).run(ep))
    assert ep.env.success() and not replies
    groups = [s.group for s in ep.samples]
    assert groups[:3] == ["e/chooser/0", "e/chooser/1", "e/placer/1"]  # no placer at turn 0
    assert ep.samples[-1].reward == 2.0  # +1 correct, +1 team reward (alpha 1) for the last digit


def test_observation_format_and_characters() -> None:
    env = make_env(PUZZLE)
    assert env.observe("chooser") == "C\n1:ABC4\n2:D412\n3:2143\n4:4321"
    assert env.observe("placer") == "P\n1:ABC4\n2:D412\n3:2143\n4:4321"
    env.step("chooser", "D")
    assert env.observe("placer").endswith("\n4:4321\nAT=D ROW=D412 COL=AD24 BOX=ABD4")
    env.step("placer", "3")
    assert env.observe("chooser") == "C\n1:ABC4\n2:3412\n3:2143\n4:4321"
    for problem in SudokuEnv.problems("train", 10, sizes=[9], holes=26):
        env = make_env(problem)
        assert len(env.cells) == 26
        env.step("chooser", env.action_examples("chooser")[-1])
        assert set(env.observe("placer")) <= ALLOWED and set(env.observe("chooser")) <= ALLOWED


def test_clone_is_independent() -> None:
    env = make_env(PUZZLE)
    copy = env.clone()
    copy.step("chooser", "D")
    copy.step("placer", "3")
    assert env.grid[1][0] == 0 and copy.grid[1][0] == 3 and env.selected is None
    env.step("chooser", "A")
    assert copy.selected is None and env.selected == (0, 0)


def test_problem_options_and_mistakes() -> None:
    with pytest.raises(ValueError, match="sizes"):
        SudokuEnv.problems("train", 1, sizes=[6])
    with pytest.raises(ValueError, match="holes"):
        SudokuEnv.problems("train", 1, holes=0)
    with pytest.raises(ValueError, match="one letter per empty cell"):
        SudokuEnv.problems("train", 1, sizes=[9], holes=27)
    with pytest.raises(ValueError, match="at most"):
        SudokuEnv.problems("train", 1, holes=15)
    with pytest.raises(ValueError, match="split"):
        SudokuEnv.problems("dev", 1)
    with pytest.raises(ValueError, match="disagree"):
        make_env({**PUZZLE, "puzzle": ["2..4", ".412", "2143", "4321"]})
    with pytest.raises(ValueError, match="rows"):
        make_env({**PUZZLE, "puzzle": ["...4"]})
    with pytest.raises(ValueError, match="unknown agent"):
        make_env(PUZZLE).observe("solver")


def test_prompts_fit_the_tiny_model() -> None:
    from mas_async.rollout.chat_prompt import chat_prompt_ids
    from mas_async.tiny_model import PRESETS, UNK_TOKEN, VOCAB, build_tokenizer

    tokenizer = build_tokenizer()
    longest = 0
    for problem in SudokuEnv.problems("train", 10, sizes=[9], holes=26):
        env = make_env(problem)
        env.step("chooser", "A")
        ids = chat_prompt_ids(tokenizer, DigitPlacer().prompt(env.observe("placer")))
        assert VOCAB.index(UNK_TOKEN) not in ids.tolist()
        longest = max(longest, len(ids))
    assert longest < PRESETS["tiny-char"].max_position_embeddings // 2
