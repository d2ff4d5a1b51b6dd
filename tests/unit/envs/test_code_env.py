"""The code env, its nodes and workflow: datasets, parsing, rewards against hand-computed cases (invalid
answers included), an episode of the parallel workflow, concurrent candidate scoring, and the loaders."""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
import time
import zlib
from pathlib import Path

import pytest

from envs.code import CodeEnv
from envs.code_data import load_humaneval, load_jsonl, load_own
from mas_async.api import ParseError, run_tests
from nodes import code as code_nodes  # a test module may not hold a class named "Test*"
from nodes.code import Coder, CodeWorkflow
from tests.support.chat_fakes import ScriptedGenerate, make_episode

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run one at a time (make test)

FULL = "```python\ndef sum_of_squares(n):\n    return sum(i * i for i in range(1, n + 1))\n```"
# Passes 3 of the 4 hidden tests (n = 3, 0, -2; not n = 10).
PARTIAL = "```python\ndef sum_of_squares(n):\n    return sum(i * i for i in range(1, n + 1)) if n < 5 else 0\n```"
GOOD_TESTS = "```python\nassert sum_of_squares(3) == 14\nassert sum_of_squares(1) == 1\n```"
# One right test, one wrong (the reference gives 5), one that never calls the function.
MIXED_TESTS = "```python\nassert sum_of_squares(3) == 14\nassert sum_of_squares(2) == 4\nassert True\n```"


@pytest.fixture
def problem() -> dict:
    first = load_own()[0]
    assert first["entry_point"] == "sum_of_squares" and len(first["tests"]) == 4
    return first


def test_datasets_are_disjoint_and_sized() -> None:
    own, humaneval = load_own(), load_humaneval()
    assert len(own) == 32 and len(humaneval) == 164
    assert not {p["id"] for p in own} & {p["id"] for p in humaneval}
    assert not {p["entry_point"] for p in own} & {p["entry_point"] for p in humaneval}
    assert len(CodeEnv.problems("train", 5)) == 5 and len(CodeEnv.problems("train", 4096)) == 32
    assert CodeEnv.problems("test", 2)[0]["id"] == "HumanEval/0"
    with pytest.raises(ValueError, match="unknown split"):
        CodeEnv.problems("dev", 1)


def _judged(problem: dict) -> dict:
    return {"entry_point": problem["entry_point"], "prompt": problem["prompt"]}


def test_own_reference_solutions_pass_and_stubs_fail() -> None:
    async def main() -> tuple[list[list[bool]], list[list[bool]]]:
        own = load_own()
        right = await asyncio.gather(*(run_tests(p["solution"], p["tests"], **_judged(p)) for p in own))
        stubs = await asyncio.gather(
            *(run_tests(p["prompt"] + "    return None\n", p["tests"], **_judged(p)) for p in own)
        )
        return right, stubs

    right, stubs = asyncio.run(main())
    assert all(all(r) for r in right)
    assert not any(all(r) for r in stubs)


def test_coder_parse() -> None:
    coder = Coder()
    assert coder.parse(FULL).startswith("def sum_of_squares")
    assert coder.parse("<think>```python\nx = (\n```</think>\n" + FULL).startswith("def")  # thinking ignored
    for text in ("def f(): return 1", "```python\ndef f(:\n```", "<think>" + FULL, "```python\n\n```", ""):
        with pytest.raises(ParseError):
            coder.parse(text)


def test_tester_parse() -> None:
    tester = code_nodes.Tester()
    tests = tester.parse("```python\nimport math\nassert f(1) == 2\nx = 3\nassert f(x) == math.floor(4.5)\n```")
    assert tests == [
        {"code": "import math\nx = 3\nassert f(1) == 2"},
        {"code": "import math\nx = 3\nassert f(x) == math.floor(4.5)"},
    ]
    pairs = tester.parse("Test:\n```input\n1 2\n```\n```output\n3\n```\n```input\n0 0\n```\n```output\n0\n```")
    assert pairs == [{"input": "1 2\n", "output": "3\n"}, {"input": "0 0\n", "output": "0\n"}]
    assert len(tester.parse("```python\n" + "assert f(1)\n" * 30 + "```")) == 10
    for text in ("assert f(1) == 2", "```python\nprint(1)\n```", "```python\nassert (\n```", "%$#@"):
        with pytest.raises(ParseError):
            tester.parse(text)


def test_rewards_hand_computed(problem: dict) -> None:
    env = CodeEnv()
    env.reset(options={"problem": problem})
    assert env.team_reward() == 0.0 and not env.done
    before = env.clone()
    env.step("coder", Coder().parse(PARTIAL))
    assert env.pass_ratio() == env.team_reward() == 0.75
    assert Coder().local_reward(before, None, env) == 0.75 and before.code is None  # the clone is untouched
    assert not env.done  # no tests yet
    env.step("tester", code_nodes.Tester().parse(MIXED_TESTS))
    assert env.test_agreement() == pytest.approx(1 / 3)  # right, wrong, and a test that never calls it
    assert env.on_tests == [True, False, True] and not env.done
    assert "passes 2 of 3 tests" in env.observe("coder") and "sum_of_squares(2) == 4" in env.observe("tester")
    tester_before = env.clone()
    env.step("tester", code_nodes.Tester().parse(GOOD_TESTS))
    assert env.test_agreement() == 1.0 and env.on_tests == [True, True]
    # Valid tests, each failing a constant-returning variant (the coder's wrong program passes them).
    assert code_nodes.Tester().local_reward(tester_before, None, env) == env.tester_reward() == 1.0
    assert not env.done  # the code passes the generated tests, but the hidden tests still fail one
    assert env.team_reward() == 0.75 and not env.success()
    assert "hidden" not in env.observe("coder") and "385" not in env.observe("coder")  # ground truth stays hidden
    env.step("coder", Coder().parse(FULL))
    assert env.team_reward() == 1.0 and env.done and env.success()  # the hidden tests pass: the end


def test_parallel_episode_scores_every_candidate_and_joins_the_turn(problem: dict) -> None:
    env = CodeEnv()
    env.reset(options={"problem": problem})
    # The best candidate is the last one on both sides, so a workflow that commits candidate 0 (or any
    # fixed index) fails this test.
    generate = ScriptedGenerate(
        {"coder": [[PARTIAL, "I cannot code", FULL]], "tester": [[MIXED_TESTS, "no tests", GOOD_TESTS]]}
    )
    episode = make_episode(env, ("coder", "tester"), generate, k=3)
    workflow = CodeWorkflow({"coder": Coder(), "tester": code_nodes.Tester()}, max_turns=3)
    asyncio.run(workflow.run(episode))
    assert generate.calls == [("coder", 3), ("tester", 3)]  # one request per agent, then solved
    rewards = {(s.agent, s.info["index"]): s.reward for s in episode.samples}
    assert rewards[("coder", 0)] == 1.5 and rewards[("coder", 1)] == -1.0 and rewards[("coder", 2)] == 2.0
    assert rewards[("tester", 2)] == 1.0 and rewards[("tester", 1)] == -1.0
    # No code on the tester's clone (team reward 0): of its 3 tests one discriminates (f(3) == 14 fails
    # the constants), one is wrong (the reference fails it) and `assert True` catches nothing: (1 - 1) / 3.
    assert rewards[("tester", 0)] == 0.0
    assert [s.valid for s in episode.samples] == [True, False, True, True, False, True]
    assert {s.group for s in episode.samples} == {"e0/coder/0", "e0/tester/0"}
    assert [(c.agent, c.index) for c in episode.committed] == [("coder", 2), ("tester", 2)]  # the best of each
    assert episode.env.code == Coder().parse(FULL) and episode.env.tests == code_nodes.Tester().parse(GOOD_TESTS)
    assert episode.env.done and episode.finish()["success"] is True


def test_candidates_run_in_the_sandbox_concurrently(problem: dict) -> None:
    slow = [f"```python\nimport time\ntime.sleep(2)\ndef sum_of_squares(n):\n    return {i}\n```" for i in range(4)]
    env = CodeEnv(per_test_s=10.0)
    env.reset(options={"problem": problem})
    episode = make_episode(env, ("coder", "tester"), ScriptedGenerate({"coder": [slow]}), k=4)
    start = time.monotonic()
    candidates = asyncio.run(episode.sample(Coder(), 4))
    assert time.monotonic() - start < 6.0  # four 2 s programs overlapped (one after another: 8 s)
    assert [c.reward for c in candidates] == [1.0, 0.0, 0.0, 0.0]  # `return 0` passes n = 0 and n = -2
    assert candidates[0].env.ground_truth == [False, True, True, False]


def test_loaders_read_apps_code_contests_and_livecodebench(tmp_path: Path) -> None:
    private = [{"input": "2\n3", "output": "5", "testtype": "functional"}]
    packed = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(private)))).decode()
    rows = [
        {"problem_id": 7, "question": "Add two numbers.", "solutions": json.dumps(["a, b = map(int, input().split())\nprint(a + b)"]),
         "input_output": json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]})},
        {"problem_id": 8, "question": "Write add(a, b).", "solutions": "[]",
         "input_output": json.dumps({"fn_name": "add", "inputs": [[1, 2]], "outputs": [[3]]})},
        {"name": "cc1", "description": "Echo the number.", "public_tests": {"input": ["4\n"], "output": ["4\n"]},
         "private_tests": {"input": ["9\n"], "output": ["9\n"]},
         "solutions": {"language": [2, 3], "solution": ["int main(){}", "print(input())"]}},
        {"question_id": "lc1", "question_content": "Add.", "starter_code": "class Solution:\n    def add(self, a, b):",
         "public_test_cases": json.dumps([{"input": "1\n2", "output": "3", "testtype": "functional"}]),
         "private_test_cases": packed, "metadata": json.dumps({"func_name": "add"})},
    ]  # fmt: skip
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    apps_io, apps_fn, contests, lcb = load_jsonl(path)
    assert apps_io["entry_point"] == "" and apps_io["tests"][0] == {"input": "1 2\n", "output": "3\n"}
    assert apps_fn["entry_point"] == "add" and apps_fn["solution"] is None
    assert contests["solution"] == "print(input())" and len(contests["tests"]) == 2
    assert lcb["entry_point"] == "Solution" and len(lcb["tests"]) == 2 and lcb["solution"] is None

    async def main() -> list[list[bool]]:
        adder = "def add(a, b):\n    return a + b\n"
        lcb_solution = "class Solution:\n    def add(self, a, b):\n        return a + b\n"
        return await asyncio.gather(
            run_tests(apps_io["solution"], apps_io["tests"]),
            run_tests(adder, apps_fn["tests"], entry_point="add"),
            run_tests(contests["solution"], contests["tests"]),
            run_tests(lcb_solution, lcb["tests"], entry_point="Solution"),
            run_tests("print(0)", contests["tests"]),
        )

    assert asyncio.run(main()) == [[True, True], [True], [True, True], [True, True], [False, False]]


def test_a_crafted_pickle_in_a_dataset_is_refused(tmp_path: Path) -> None:
    evil = base64.b64encode(zlib.compress(pickle.dumps(print))).decode()
    row = {"question_content": "x", "public_test_cases": "[]", "private_test_cases": evil}
    (tmp_path / "evil.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
        load_jsonl(tmp_path / "evil.jsonl")


def test_code_prompts_tokenize_without_unknowns_in_the_ascii_tiny_model(problem: dict) -> None:
    from mas_async.tiny_model import build_tokenizer

    tokenizer = build_tokenizer("tiny-ascii")
    env = CodeEnv()
    env.reset(options={"problem": problem})
    messages = Coder().prompt(env.observe("coder"))
    text = "".join(m["content"] for m in messages) + "\t~{}"
    assert tokenizer.unk_token_id not in tokenizer(text)["input_ids"]
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text
