"""The Plan-Path movers for small instruct models: the prompt they send and the answer they read."""

from __future__ import annotations

import pytest

from envs.plan_path import PlanPathEnv
from mas_async.api import NODES, ParseError, resolve
from nodes.plan_path_answer import AnswerHorizontalMover, AnswerVerticalMover, describe


def test_exactly_one_answer_with_exactly_one_move() -> None:
    vertical, horizontal = AnswerVerticalMover(), AnswerHorizontalMover()
    assert vertical.parse("Answer: U") == "U"
    assert vertical.parse("G is below, so I go down. answer: down") == "D"
    assert vertical.parse("Answer: **D**.") == "D"
    assert horizontal.parse("Answer: R<|im_end|>") == "R"
    assert horizontal.parse("ANSWER: Left") == "L"


@pytest.mark.parametrize(
    "text",
    [
        "Answer: U or D",  # two moves
        "Answer: U. Answer: D maybe",  # two answers, and a word after the move
        "Answer: U\nWait. Answer: D.",  # two answers
        "Answer: D maybe",
        "Answer: go Up",
        "U",
        "The token moves D",
        "Answer:",
        "Answer: G",
        "Answer: #A",
        "Answer: u",  # a letter must be a capital
        "Answer: L",  # the partner's move
        "Answer: UD",
    ],
)
def test_anything_else_is_a_parse_error(text: str) -> None:
    with pytest.raises(ParseError):
        AnswerVerticalMover().parse(text)


def problem(start: list[int], goal: list[int], walls: list[list[int]]) -> dict:
    return {"seed": 0, "rows": 4, "cols": 4, "walls": walls, "start": start, "goal": goal}


def test_the_question_says_where_the_goal_lies_on_the_movers_axis_and_which_moves_are_free() -> None:
    env = PlanPathEnv()
    env.reset(options={"problem": problem([2, 1], [0, 3], walls=[[3, 1], [2, 0]])})
    assert describe(env.observe("vertical"), "vertical") == "G is 2 rows above A. Up: free. Down: wall."
    assert describe(env.observe("horizontal"), "horizontal") == "G is 2 columns right of A. Left: wall. Right: free."
    env.reset(options={"problem": problem([0, 3], [1, 3], walls=[])})
    assert describe(env.observe("vertical"), "vertical") == "G is 1 row below A. Up: wall. Down: free."
    assert describe(env.observe("horizontal"), "horizontal") == "G is in the same column as A. Left: free. Right: wall."


def test_prompt_has_the_rules_two_examples_with_different_answers_then_the_question() -> None:
    env = PlanPathEnv()
    env.reset(options={"problem": PlanPathEnv.problems("test", 1, sizes=[4])[0]})
    for mover in (AnswerVerticalMover(), AnswerHorizontalMover()):
        messages = mover.prompt(env.observe(mover.agent))
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
        assert f"Answer: {' or '.join(mover.moves)}" in messages[0]["content"]
        answers = {mover.parse(messages[i]["content"]) for i in (2, 4)}
        assert answers == set(mover.moves)
        assert messages[-1]["content"] == describe(env.observe(mover.agent), mover.agent)


def test_the_worked_examples_are_what_describe_writes_for_a_real_grid() -> None:
    # The vertical examples: A at (2, 1), G two rows above; A at (0, 1), G one row below, the edge above.
    env = PlanPathEnv()
    env.reset(options={"problem": problem([2, 1], [0, 2], walls=[])})
    first = AnswerVerticalMover().prompt(env.observe("vertical"))[1]["content"]
    assert describe(env.observe("vertical"), "vertical") == first


def test_registered_and_describe_rejects_a_foreign_observation() -> None:
    assert resolve("plan_path_vertical_answer", NODES, "node") is AnswerVerticalMover
    with pytest.raises(ValueError, match="A=r,c"):
        describe("V\n....\n", "vertical")
