"""The Plan-Path movers for small instruct models: the prompt they send and the answer they read."""

from __future__ import annotations

import pytest

from envs.plan_path import PlanPathEnv
from mas_async.api import NODES, ParseError, resolve
from nodes.plan_path_answer import AnswerHorizontalMover, AnswerVerticalMover, describe


def test_answer_after_the_last_answer_marker() -> None:
    vertical, horizontal = AnswerVerticalMover(), AnswerHorizontalMover()
    assert vertical.parse("Answer: U") == "U"
    assert vertical.parse("I think D. answer: down") == "D"
    assert vertical.parse("Answer: U\nWait. Answer: D.") == "D"
    assert vertical.parse("Answer: go Up, not D") == "D"  # the last move after the last marker
    assert horizontal.parse("Answer: R<|im_end|>") == "R"
    assert horizontal.parse("ANSWER: Left") == "L"


@pytest.mark.parametrize(
    "text",
    ["U", "The token moves D", "Answer:", "Answer: G", "Answer: #A", "Answer: u", "Answer: L", "Answer: UD"],
)
def test_no_move_after_the_marker_is_a_parse_error(text: str) -> None:
    with pytest.raises(ParseError):
        AnswerVerticalMover().parse(text)


def test_prompt_has_the_rules_one_example_and_the_positions_in_words() -> None:
    env = PlanPathEnv()
    env.reset(options={"problem": PlanPathEnv.problems("test", 1, sizes=[4])[0]})
    messages = AnswerVerticalMover().prompt(env.observe("vertical"))
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert "up (U) or down (D)" in messages[0]["content"] and "Answer: U or D" in messages[0]["content"]
    assert messages[2]["content"] == "Answer: U"
    r, c = env.position
    gr, gc = env.goal
    assert messages[3]["content"].endswith(f"A is in row {r}, column {c}. G is in row {gr}, column {gc}.")
    assert "Answer: L or R" in AnswerHorizontalMover().prompt(env.observe("horizontal"))[0]["content"]


def test_registered_and_describe_rejects_a_foreign_observation() -> None:
    assert resolve("plan_path_vertical_answer", NODES, "node") is AnswerVerticalMover
    with pytest.raises(ValueError, match="A=r,c"):
        describe("V\n....\n")
