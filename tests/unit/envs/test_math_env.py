"""The math envs, nodes and workflows: answer equivalence (numbers, fractions, expressions, LaTeX),
parsing, rewards against hand-computed cases (invalid answers included), the tool run in the sandbox,
episodes of the parallel and the routed workflow, and the loaders."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from envs.math import MathEnv, RoutedMathEnv
from envs.math_data import equivalent, last_boxed, load_jsonl, load_split
from mas_async.api import ParseError
from nodes.math import MathWorkflow, Reasoner, ToolUser
from nodes.routed import RoutedWorkflow, Solver, Verifier
from tests.support.chat_fakes import ScriptedGenerate, make_episode

HALF = {"id": "t/0", "problem": "What is $1 - \\frac{1}{2}$?", "answer": "\\frac{1}{2}"}


@pytest.mark.parametrize(
    ("gold", "answer"),
    [
        ("3", "3.0"),  # numbers
        ("10", "010"),
        ("-\\frac{5}{2}", "-2.5"),  # fractions and decimals
        ("\\frac{1}{2}", "1/2"),
        ("\\frac12", "\\dfrac{1}{2}"),
        ("50\\%", "0.5"),
        ("x^2+6x+9", "(x+3)^2"),  # expressions
        ("2\\sqrt{2}", "\\sqrt{8}"),  # LaTeX
        ("\\{1,2\\}", "\\{2,1\\}"),
        ("$\\frac{3}{4}$", "0.75"),
    ],
)
def test_equivalent_answers(gold: str, answer: str) -> None:
    assert equivalent(gold, answer)


@pytest.mark.parametrize(
    ("gold", "answer"),
    [
        ("7", "8"),
        ("\\frac{1}{3}", "0.33"),
        ("x+3", "x-3"),
        ("2\\sqrt{2}", "2"),
        ("1", None),
        ("1", ""),
        ("1", "1" * 300),
    ],
)
def test_different_answers(gold: str, answer: str | None) -> None:
    assert not equivalent(gold, answer)


def test_last_boxed() -> None:
    assert last_boxed("so \\boxed{1} or rather \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("\\boxed{\\frac{1}{2}") is None and last_boxed("no box") is None


def test_reasoner_and_tool_user_parse() -> None:
    action = Reasoner().parse("<think>maybe \\boxed{3}</think>Half of it: \\boxed{\\frac{1}{2}}")
    assert action == {"answer": "\\frac{1}{2}", "reasoning": "Half of it: \\boxed{\\frac{1}{2}}"}
    assert ToolUser().parse("```python\nprint(1/2)\n```") == {"code": "print(1/2)\n"}
    for text in ("the answer is 1/2", "\\boxed{}", "<think>\\boxed{1}", ""):
        with pytest.raises(ParseError):
            Reasoner().parse(text)
    for text in ("print(1)", "```python\nprint(\n```"):
        with pytest.raises(ParseError):
            ToolUser().parse(text)


def test_math_rewards_hand_computed() -> None:
    env = MathEnv()
    env.reset(options={"problem": HALF})
    before = env.clone()
    env.step("reasoner", {"answer": "0.5", "reasoning": "1 - 1/2"})
    assert env.team_reward() == 1.0 and Reasoner().local_reward(before, None, env) == 1.0 and not env.done
    env.step("tool_user", {"code": "print(1 / 3)"})
    assert env.tool_answer == "0.3333333333333333" and ToolUser().local_reward(before, None, env) == 0.0
    assert not env.done and "differ" in env.observe("reasoner")
    env.step("tool_user", {"code": "from fractions import Fraction\nprint(Fraction(1, 2))"})
    assert env.tool_answer == "1/2" and env.done  # the answers agree: the end
    env.step("tool_user", {"code": "raise ValueError('no')"})
    assert env.tool_answer is None and "ValueError" in env.tool_output and not env.done
    env.step("reasoner", {"answer": "2", "reasoning": ""})
    assert env.team_reward() == 0.0 and before.reasoner_answer is None  # the clone never changed


def test_routed_rewards_hand_computed() -> None:
    env = RoutedMathEnv()
    env.reset(options={"problem": HALF})
    env.step("solver", {"answer": "1/3", "reasoning": ""})
    assert env.team_reward() == 0.0
    env.step("verifier", {"verdict": "approve", "feedback": ""})
    assert not env.verdict_right() and env.done  # approving a wrong answer ends the episode, unrewarded
    env.reset(options={"problem": HALF})
    env.step("solver", {"answer": "1/3", "reasoning": ""})
    env.step("verifier", {"verdict": "reject", "feedback": "1 - 1/2 is not 1/3"})
    assert env.verdict_right() and not env.done and "1 - 1/2 is not 1/3" in env.observe("solver")
    env.step("solver", {"answer": "\\frac{2}{4}", "reasoning": ""})
    assert env.verdict is None and env.team_reward() == 1.0
    with pytest.raises(ValueError, match="verdict"):
        env.step("verifier", {"verdict": "maybe", "feedback": ""})
    with pytest.raises(ValueError, match="unknown agent"):
        env.step("reasoner", {"answer": "1", "reasoning": ""})


def test_verifier_parse() -> None:
    assert Verifier().parse("1 - 1/2 = 1/2, correct.\nVERDICT: APPROVE") == {
        "verdict": "approve",
        "feedback": "1 - 1/2 = 1/2, correct.",
    }
    assert Verifier().parse("Wrong sign. **VERDICT: reject**")["verdict"] == "reject"
    with pytest.raises(ParseError):
        Verifier().parse("looks fine to me")


def test_parallel_math_episode() -> None:
    env = MathEnv()
    env.reset(options={"problem": HALF})
    generate = ScriptedGenerate(
        {
            "reasoner": [["\\boxed{0.5}", "no idea"], ["\\boxed{1/2}"] * 2],
            "tool_user": [
                ["```python\nprint(0.25)\n```", "```python\nprint(0.5)\n```"],
                ["nothing", "```python\n1/0\n```"],
            ],
        }
    )
    episode = make_episode(env, ("reasoner", "tool_user"), generate, k=2)
    asyncio.run(MathWorkflow({"reasoner": Reasoner(), "tool_user": ToolUser()}, max_turns=2).run(episode))
    assert generate.calls == [("reasoner", 2), ("tool_user", 2)]  # both answered 1/2 in turn 0: agreed
    rewards = [(s.agent, s.turn, s.reward) for s in episode.samples]
    assert rewards == [("reasoner", 0, 2.0), ("reasoner", 0, -1.0), ("tool_user", 0, 0.0), ("tool_user", 0, 2.0)]
    assert episode.env.done and episode.finish()["success"] is True


def test_routed_episode_loops_back_on_a_rejection() -> None:
    env = RoutedMathEnv()
    env.reset(options={"problem": HALF})
    generate = ScriptedGenerate(
        {
            "solver": [["\\boxed{1/3}"], ["\\boxed{1/2}"]],
            "verifier": [["No: 1 - 1/2 = 1/2. VERDICT: REJECT"], ["VERDICT: APPROVE"]],
        }
    )
    episode = make_episode(env, ("solver", "verifier"), generate, k=1)
    asyncio.run(RoutedWorkflow({"solver": Solver(), "verifier": Verifier()}, max_turns=4).run(episode))
    assert generate.calls == [("solver", 1), ("verifier", 1), ("solver", 1), ("verifier", 1)]
    assert [(s.agent, s.turn, s.reward) for s in episode.samples] == [
        ("solver", 0, 0.0),
        ("verifier", 0, 1.0),  # rejected a wrong answer: right
        ("solver", 1, 2.0),
        ("verifier", 1, 2.0),  # approved a right one: team 1 + local 1
    ]
    assert episode.env.done and episode.finish()["success"] is True


def test_invalid_verdict_routes_back_with_the_penalty() -> None:
    env = RoutedMathEnv()
    env.reset(options={"problem": HALF})
    generate = ScriptedGenerate(
        {"solver": [["\\boxed{1/2}"], ["garbage"]], "verifier": [["hmm"], ["VERDICT: APPROVE"]]}
    )
    episode = make_episode(env, ("solver", "verifier"), generate, k=1)
    asyncio.run(RoutedWorkflow({"solver": Solver(), "verifier": Verifier()}, max_turns=2).run(episode))
    assert [(s.agent, s.valid, s.reward) for s in episode.samples] == [
        ("solver", True, 2.0),
        ("verifier", False, -1.0),
        ("solver", False, -1.0),  # its committed clone is unchanged: the answer 1/2 stays
        ("verifier", True, 2.0),
    ]
    assert episode.finish()["success"] is True


def test_splits_are_disjoint_and_loaders_read_public_layouts(tmp_path: Path) -> None:
    train, test = load_split("train"), load_split("test")
    assert len(train) == len(test) == 32
    assert not {p["problem"] for p in train} & {p["problem"] for p in test}
    assert MathEnv.problems("train", 3) == train[:3] and len(RoutedMathEnv.problems("test", 100)) == 32
    rows = [
        {"ID": "2024-I-1", "Problem": "Find x.", "Answer": "204"},
        {"id": 5, "question": "Compute y.", "final_answer": ["$\\frac{1}{2}$"]},
    ]
    path = tmp_path / "bench.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    aime, olympiad = load_jsonl(path)
    assert aime == {"id": "bench/2024-I-1", "problem": "Find x.", "answer": "204"}
    assert olympiad["answer"] == "\\frac{1}{2}" and olympiad["problem"] == "Compute y."
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "no problem here"}))
    with pytest.raises(ValueError, match="needs a problem"):
        load_jsonl(tmp_path / "bad.jsonl")
