"""The code tester's local reward and the code episode's end (`envs/code.py`, `nodes/code.py`): a generated
test earns credit only if the reference solution passes it and it discriminates (fails a plausible wrong
program: a constant-returning variant, a mutant of the reference, the coder's wrong program), so a test
that only rules out None earns nothing; a test the reference fails is penalised; the hidden tests, not
agreement with the tester, end the episode."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from envs.code import CodeEnv
from envs.code_data import load_own
from envs.code_wrong import mutants
from mas_async.api import run_tests, run_tests_on_constant
from nodes import code as code_nodes  # a test module may not hold a class named "Test*"
from nodes.code import Coder, CodeWorkflow
from tests.support.chat_fakes import ScriptedGenerate, make_episode
from tests.unit.envs.test_code_env import FULL, GOOD_TESTS, PARTIAL  # PARTIAL fails only n = 10

TAUTOLOGY = "```python\nassert sum_of_squares(1) == sum_of_squares(1)\n```"
EXPOSES_BUG = "```python\nassert sum_of_squares(10) == 385\n```"  # PARTIAL returns 0 for n = 10
WRONG = "```python\nassert sum_of_squares(2) == 4\n```"  # the reference gives 5
NOT_NONE = "```python\nassert sum_of_squares(3) is not None\n```"  # fails only a program returning None


@pytest.fixture
def problem() -> dict[str, Any]:
    return load_own()[0]  # sum_of_squares, 4 hidden tests


def _env(problem: dict[str, Any], code: str | None = None) -> CodeEnv:
    env = CodeEnv()
    env.reset(options={"problem": problem})
    if code is not None:
        env.step("coder", Coder().parse(code))
    return env


def _tester_reward(env: CodeEnv, answer: str) -> float:
    """The tester's local reward for `answer` played on a clone of `env` (as the episode scores it)."""
    tester = code_nodes.Tester()
    action = tester.parse(answer)
    after = env.clone()
    after.step("tester", action)
    return tester.local_reward(env, action, after)


def test_a_tautology_earns_nothing_and_less_than_a_test_that_exposes_the_bug(problem: dict[str, Any]) -> None:
    env = _env(problem, PARTIAL)
    assert _tester_reward(env, TAUTOLOGY) == 0.0  # passes the reference, the stub and the wrong program alike
    assert _tester_reward(env, EXPOSES_BUG) == 1.0  # fails the stub and the coder's wrong program
    assert _tester_reward(env, GOOD_TESTS) == 1.0  # valid, each fails a constant-returning variant
    assert _tester_reward(_env(problem), TAUTOLOGY) == 0.0  # with no program yet, the stub is the one to fail


def test_a_test_the_reference_fails_is_penalised(problem: dict[str, Any]) -> None:
    env = _env(problem, PARTIAL)
    assert _tester_reward(env, WRONG) == -1.0  # fails every program, the reference too: no credit, a penalty
    both = "```python\nassert sum_of_squares(10) == 385\nassert sum_of_squares(2) == 4\n```"
    assert _tester_reward(env, both) == 0.0  # one test discriminates, one is invalid
    assert _tester_reward(env, "```input\n3\n```\n```output\n14\n```") == -1.0  # stdin tests for a function


def test_a_correct_program_is_no_target_and_without_a_reference_nothing_is_credited(problem: dict[str, Any]) -> None:
    solved = _env(problem, FULL)
    assert _tester_reward(solved, EXPOSES_BUG) == 1.0  # it fails the constants and the mutants
    assert _tester_reward(solved, TAUTOLOGY) == 0.0
    unchecked = _env({**problem, "solution": None}, PARTIAL)
    assert _tester_reward(unchecked, EXPOSES_BUG) == _tester_reward(unchecked, WRONG) == 0.0


def test_agreeing_with_the_tester_does_not_end_the_episode(problem: dict[str, Any]) -> None:
    env = _env(problem, PARTIAL)
    env.step("tester", code_nodes.Tester().parse(TAUTOLOGY))
    assert env.on_tests == [True] and env.pass_ratio() == 0.75  # the code passes its tests, not the hidden ones
    assert env.terminations == {"coder": False, "tester": False} and not env.done
    env.step("tester", code_nodes.Tester().parse(GOOD_TESTS))
    assert all(env.on_tests) and not env.done


def test_a_tautological_tester_does_not_end_a_parallel_episode(problem: dict[str, Any]) -> None:
    env = _env(problem)
    turn = {"coder": [PARTIAL, PARTIAL], "tester": [TAUTOLOGY, TAUTOLOGY]}
    generate = ScriptedGenerate({agent: [texts, texts] for agent, texts in turn.items()})
    episode = make_episode(env, ("coder", "tester"), generate, k=2)
    asyncio.run(CodeWorkflow({"coder": Coder(), "tester": code_nodes.Tester()}, max_turns=2).run(episode))
    assert generate.calls == [("coder", 2), ("tester", 2)] * 2  # both turns played: agreeing ended nothing
    assert all(episode.env.on_tests) and not episode.env.done and episode.finish()["success"] is False
    assert [c.local_reward for c in episode.committed if c.agent == "tester"] == [0.0, 0.0]


def test_passing_the_hidden_tests_ends_the_episode(problem: dict[str, Any]) -> None:
    env = _env(problem, FULL)
    assert env.terminations == {"coder": True, "tester": True}  # no generated tests needed
    disputed = _env(problem, PARTIAL)
    disputed.step("tester", code_nodes.Tester().parse(WRONG))
    disputed.step("coder", Coder().parse(FULL))
    assert disputed.on_tests == [False] and disputed.done  # a wrong generated test does not keep it going


def test_a_test_that_only_rules_out_none_earns_nothing(problem: dict[str, Any]) -> None:
    """`assert f(x) is not None` fails the program that returns None and nothing else: whatever the
    coder wrote (nothing yet, a wrong program, the right one), it is valid and earns no credit."""
    for code in (None, PARTIAL, FULL):
        env = _env(problem, code)
        assert _tester_reward(env, NOT_NONE) == 0.0
        after = env.clone()
        after.step("tester", code_nodes.Tester().parse(NOT_NONE))
        assert after.on_reference == [True]  # valid: the reference passes it
    stub = problem["prompt"] + "    return None\n"
    tests = code_nodes.Tester().parse(NOT_NONE)
    judged = {"entry_point": problem["entry_point"], "prompt": problem["prompt"]}
    assert asyncio.run(run_tests(stub, tests, **judged)) == [False]  # it does fail the None program


def test_the_wrong_programs_are_constants_and_mutants_of_the_reference(problem: dict[str, Any]) -> None:
    found = mutants(problem)  # sum(i * i for i in range(1, n + 1)): range from 2; n - 1 for n + 1
    assert found == [
        'def sum_of_squares(n: int) -> int:\n    """Return 1*1 + 2*2 + ... + n*n (0 when n <= 0).\n    >>> sum_of_squares(3)\n'
        '    14\n    """\n    return sum((i * i for i in range(2, n + 1)))',
        'def sum_of_squares(n: int) -> int:\n    """Return 1*1 + 2*2 + ... + n*n (0 when n <= 0).\n    >>> sum_of_squares(3)\n'
        '    14\n    """\n    return sum((i * i for i in range(1, n - 1)))',
    ]
    tests = [{"code": "assert sum_of_squares(1) == 1"}, {"code": "assert sum_of_squares(0) == 0"}]
    judged = {"entry_point": problem["entry_point"], "prompt": problem["prompt"]}

    async def main() -> list[list[bool]]:
        runs = [run_tests(m, tests, **judged) for m in found]
        runs += [run_tests_on_constant(value, tests, **judged) for value in (0, "", [])]
        return list(await asyncio.gather(*runs))

    # Both mutants and every constant but 0 fail f(1) == 1; f(0) == 0 fails only the non-numbers.
    assert asyncio.run(main()) == [[False, True], [False, True], [False, True], [False, False], [False, False]]
