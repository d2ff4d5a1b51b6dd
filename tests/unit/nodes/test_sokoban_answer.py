"""The Sokoban pushers for small instruct models: the prompt they send, its worked example, the answer they
read."""

from __future__ import annotations

import pytest

from envs.sokoban import SokobanEnv
from mas_async.api import NODES, ParseError, resolve
from nodes.sokoban_answer import EXAMPLE, AnswerHorizontalPusher, AnswerVerticalPusher, describe
from tests.unit.envs.test_sokoban import level

# The worked examples' rooms: the keeper one step from pushing the box onto its target.
EXAMPLE_LEVELS = {
    "vertical": level(5, 5, targets=[[1, 2]], boxes=[[2, 2]], player=[3, 2]),
    "horizontal": level(3, 6, targets=[[1, 1]], boxes=[[1, 2]], player=[1, 4]),
}
PUSHERS = {"vertical": AnswerVerticalPusher, "horizontal": AnswerHorizontalPusher}


def reset(problem: dict) -> SokobanEnv:
    env = SokobanEnv()
    env.reset(options={"problem": problem})
    return env


@pytest.mark.parametrize("agent", ["vertical", "horizontal"])
def test_the_worked_example_is_a_real_room_and_its_answer_a_right_move(agent: str) -> None:
    env = reset(EXAMPLE_LEVELS[agent])
    assert describe(env.observe(agent)) == EXAMPLE[agent]
    pusher = PUSHERS[agent]()
    messages = pusher.prompt(env.observe(agent))
    move = pusher.parse(messages[2]["content"])
    after = env.clone()
    after.step(agent, move)
    assert pusher.local_reward(env, move, after) == 1.0  # on a shortest team solution


def test_prompt_has_the_rules_one_example_and_the_positions_in_words() -> None:
    env = reset(SokobanEnv.problems("test", 1, sizes=[6])[0])
    messages = AnswerVerticalPusher().prompt(env.observe("vertical"))
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    rules = messages[0]["content"]
    assert "up (U) or down (D)" in rules and "partner moves left or right" in rules and "Answer: U or D" in rules
    keeper, boxes = env.state
    text = messages[3]["content"]
    assert f"A is in row {keeper[0]}, column {keeper[1]}." in text
    assert all(f"row {r}, column {c}" in text.split("Boxes:")[1] for r, c in boxes)
    assert "Answer: L or R" in AnswerHorizontalPusher().prompt(env.observe("horizontal"))[0]["content"]


def test_exactly_one_answer_with_one_move_and_parse_errors() -> None:
    assert AnswerVerticalPusher().parse("Push it up. Answer: up<|im_end|>") == "U"
    assert AnswerHorizontalPusher().parse("Answer: R.") == "R"
    for text in ("U", "Answer:", "Answer: L", "Answer: u", "Answer: U or D", "Answer: U. Answer: D maybe"):
        with pytest.raises(ParseError):
            AnswerVerticalPusher().parse(text)


def test_registered_and_describe_rejects_a_foreign_observation() -> None:
    assert resolve("sokoban_vertical_answer", NODES, "node") is AnswerVerticalPusher
    assert resolve("sokoban_horizontal_answer", NODES, "node") is AnswerHorizontalPusher
    with pytest.raises(ValueError, match="A=r,c"):
        describe("V\n#####\n")
