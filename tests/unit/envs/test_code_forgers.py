"""Programs that try to fake their own test results get nothing: the program's process only computes
the values the tests ask for, and another sandbox run, which the program cannot reach, judges them
(`mas_async.sandbox.tests`). Each forger is a regression test: pass_ratio 0, the episode goes on."""

from __future__ import annotations

from typing import Any

import pytest

from envs.code import CodeEnv
from envs.code_data import load_own
from mas_async.sandbox.tests import calls_only

# The forger of issue 37: it reported "passed" for every test through the old harness's own function.
REPORTER = """
import os, sys
report = sys._getframe(1).f_globals.get("_report")
for i in range(50):
    report("%d 1" % i)
os._exit(0)
"""
# The same against today's harness: find its output function in any frame, claim every test passed.
CLAIMER = """
import os, sys
frame = sys._getframe(0)
while frame is not None:
    out = frame.f_locals.get("out")
    if callable(out):
        for i in range(50):
            out({"test": i, "passed": True})
            out({"test": i, "calls": []})
        os._exit(0)
    frame = frame.f_back
"""
# An answer that equals everything.
EQUALS_ALL = """
class Anything:
    def __eq__(self, other):
        return True
    __hash__ = object.__hash__

def sum_of_squares(n):
    return Anything()
"""
# Read the expected value from the caller's code (`assert f(3) == 14` keeps 14 among its constants).
READER = """
import sys

def sum_of_squares(n):
    frame = sys._getframe(1)
    while frame is not None and not frame.f_code.co_filename.startswith("test_"):
        frame = frame.f_back  # up to the test's own code
    code = frame.f_code.co_consts if frame is not None else ()
    consts = [c for c in code if isinstance(c, int) and c != n]
    return consts[-1] if consts else -1
"""


@pytest.fixture
def problem() -> dict[str, Any]:
    return load_own()[0]  # sum_of_squares, 4 hidden tests


@pytest.mark.parametrize("forger", [REPORTER, CLAIMER, EQUALS_ALL, READER], ids=["reporter", "claimer", "eq", "reader"])
def test_a_forger_gets_pass_ratio_zero(problem: dict[str, Any], forger: str) -> None:
    env = CodeEnv()
    env.reset(options={"problem": problem})
    env.step("coder", forger)
    assert env.ground_truth == [False] * 4 and env.pass_ratio() == 0.0
    assert not env.done


def test_the_program_never_sees_the_expected_values() -> None:
    assert calls_only("assert sum_of_squares(10) == 385") == "(sum_of_squares(10),)"
    assert calls_only("assert abs(f(x) - 0.5) < 1e-06, 'close'") == "(abs(f(x) - 0.5),)"
    assert calls_only("def check(c):\n    assert c(1) == 2 and not c(2) == 3\ncheck(f)") == (
        "def check(c):\n    ((c(1),), (c(2),))\ncheck(f)"
    )
