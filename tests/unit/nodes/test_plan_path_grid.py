"""The Plan-Path movers that read the grid: the prompt carries the state and never the answer."""

from __future__ import annotations

import re

import pytest

from envs.plan_path import PlanPathEnv
from mas_async.api import NODES, ParseError, resolve
from mas_async.held_out import run_problems
from mas_async.rollout.chat_prompt import chat_prompt_ids, chat_prompt_text
from mas_async.tiny_model import build_tokenizer
from nodes.plan_path_answer import AnswerVerticalMover
from nodes.plan_path_grid import GridHorizontalMover, GridVerticalMover, SoloGridMover, show_grid

# What the old prompt (nodes/plan_path_answer.py) said, and what would say where the goal lies from A.
DIRECTION_WORDS = re.compile(
    r"\b(rows?|columns?) (above|below|left of|right of)\b|same (row|column) as|(Up|Down|Left|Right): (free|wall)"
)


def problem(start: list[int], goal: list[int], walls: list[list[int]]) -> dict:
    return {"seed": 0, "rows": 4, "cols": 4, "walls": walls, "start": start, "goal": goal}


def test_the_user_message_is_the_grid_and_the_positions() -> None:
    env = PlanPathEnv()
    env.reset(options={"problem": problem([2, 1], [0, 3], walls=[[3, 1], [2, 0]])})
    assert show_grid(env.observe("vertical")) == (
        " . . . G\n . . . .\n # A . .\n . # . .\nA: row 2, column 1. G: row 0, column 3."
    )


def test_the_prompt_says_no_direction_and_shows_no_worked_example() -> None:
    problems = PlanPathEnv.problems("test", 40, sizes=[4])
    env = PlanPathEnv()
    env.reset(options={"problem": problems[0]})
    old = " ".join(m["content"] for m in AnswerVerticalMover().prompt(env.observe("vertical")))
    assert DIRECTION_WORDS.search(old)  # the words prompt gives the direction away: the check sees it
    for mover in (GridVerticalMover(), GridHorizontalMover(), SoloGridMover()):
        answers_seen = set()
        for p in problems:
            env = PlanPathEnv()
            env.reset(options={"problem": p})
            messages = mover.prompt(env.observe("vertical"))
            assert [m["role"] for m in messages] == ["system", "user", "assistant"]
            assert messages[-1]["content"] == "Answer:"  # the reply's start: no move in it
            text = " ".join(m["content"] for m in messages)
            assert not DIRECTION_WORDS.search(text), text
            answers_seen.add(messages[1]["content"])
        assert len(answers_seen) == len(problems)  # every grid its own question: no lookup table of a few


def test_the_reply_continues_the_answer_and_must_be_exactly_one_move() -> None:
    vertical, horizontal, solo = GridVerticalMover(), GridHorizontalMover(), SoloGridMover()
    assert vertical.parse(" U<|im_end|>") == "U"
    assert horizontal.parse(" right") == "R"
    assert solo.parse(" L") == "L"
    for text in (" U or D", " L", " D. Answer: U", "", " A", " u"):
        with pytest.raises(ParseError):
            vertical.parse(text)


def test_the_chat_template_continues_the_partial_reply() -> None:
    tokenizer = build_tokenizer()
    env = PlanPathEnv()
    env.reset(options={"problem": problem([2, 1], [0, 3], walls=[])})
    messages = GridVerticalMover().prompt(env.observe("vertical"))
    text = chat_prompt_text(tokenizer, messages)
    assert text.endswith("Answer:")  # no end of turn after it, and no new assistant turn
    assert chat_prompt_ids(tokenizer, messages).tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    closed = chat_prompt_text(tokenizer, messages[:-1])  # a prompt that ends with the user: a new reply opens
    assert text.startswith(closed)


def test_registered() -> None:
    assert resolve("plan_path_vertical_grid", NODES, "node") is GridVerticalMover
    assert resolve("plan_path_horizontal_grid", NODES, "node") is GridHorizontalMover
    assert resolve("plan_path_solo_grid", NODES, "node") is SoloGridMover


def test_the_grid_runs_held_out_problems_are_no_training_problem_in_disguise() -> None:
    from mas_async.api import problem_content

    train, test = run_problems(PlanPathEnv, 4096, 64, {"sizes": [4]})
    seen = {problem_content(p) for p in train}
    assert len(test) == 64 and not any(problem_content(p) in seen for p in test)
    # The split by seeds alone holds 4 training problems among its first 64 test problems.
    plain = PlanPathEnv.problems("test", 64, sizes=[4])
    assert sum(problem_content(p) in seen for p in plain) == 4
