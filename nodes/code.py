"""Nodes and workflow for the code env (`envs/code.py`): a coder and a tester act in parallel each turn.

- `Coder`: answers with one ```python block (the whole function or program); the block must parse.
  Its local reward is the fraction of hidden ground-truth tests its program passes.
- `Tester`: answers with unit tests: assert statements in one ```python block for a function task
  (each top-level assert is one test; other top-level statements, such as imports, are kept in front of
  every test), or ```input / ```output block pairs for a stdin task. Its local reward is
  `CodeEnv.tester_reward()`: credit for valid tests (the reference solution passes them) that fail a
  program known to be wrong (the coder's current program when it fails a hidden test, or a stub), a
  penalty for tests the reference fails, nothing for tests every program passes.
- `CodeWorkflow`: the parallel workflow (`nodes/parallel.py`) over ("coder", "tester"), default 4 turns;
  the env ends the episode once the code passes the hidden tests (not when it passes the tester's).

An answer without the expected block, or whose code does not parse, is a ParseError: the candidate is
kept with the penalty (`invalid_penalty`, -1.0), never dropped.
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any

from mas_async.api import Node, ParseError
from nodes.parallel import ParallelWorkflow
from nodes.parsing import fenced_blocks, python_block, strip_thinking

if TYPE_CHECKING:
    from envs.code import CodeEnv

MAX_TESTS = 10  # tests kept from one tester answer

CODER_SYSTEM = """You are the coder in a team of two: you write the code, a tester writes unit tests for it.
Read the task. When they are shown, read the current code, the tester's tests and which tests fail: fix
the code if it is wrong, but remember that a test may be wrong too.
Think step by step, then give your complete solution as ONE ```python code block at the end:
- for a function task, the complete function with any imports and helpers (do not call it);
- for a program task, a complete program that reads standard input and prints the answer."""

TESTER_SYSTEM = """You are the tester in a team of two: a coder writes the code, you write the unit tests
that decide whether it is correct. Read the task; when shown, read the current code and its results.
Write tests that any correct solution passes: the examples of the task and a few edge cases, with
expected values you have checked by hand.
- For a function task, give 3 to 10 assert statements calling the function, in ONE ```python block:
```python
assert add(1, 2) == 3
```
- For a program task, give each test as an ```input block followed by its ```output block."""


class Coder(Node):
    """Writes the program (see the module docstring)."""

    def __init__(self, agent: str = "coder") -> None:
        super().__init__(agent)

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        return [{"role": "system", "content": CODER_SYSTEM}, {"role": "user", "content": str(obs)}]

    def parse(self, text: str) -> str:
        return python_block(text, self.agent)

    def local_reward(self, before: CodeEnv, action: Any, after: CodeEnv) -> float:
        return after.pass_ratio()


class Tester(Node):
    """Writes unit tests (see the module docstring)."""

    def __init__(self, agent: str = "tester") -> None:
        super().__init__(agent)

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        return [{"role": "system", "content": TESTER_SYSTEM}, {"role": "user", "content": str(obs)}]

    def parse(self, text: str) -> list[dict[str, str]]:
        body = strip_thinking(text)
        blocks = fenced_blocks(body)
        pairs = [
            {"input": given, "output": expected}
            for (tag, given), (next_tag, expected) in zip(blocks, blocks[1:], strict=False)
            if tag == "input" and next_tag == "output"
        ]
        if any(tag in ("python", "py", "python3", "") for tag, _ in blocks) and not pairs:
            return assert_tests(python_block(text, self.agent), self.agent)[:MAX_TESTS]
        if not pairs:
            raise ParseError(f"{self.agent}: no ```python block of asserts and no ```input/```output pairs")
        return pairs[:MAX_TESTS]

    def local_reward(self, before: CodeEnv, action: Any, after: CodeEnv) -> float:
        return after.tester_reward()


def assert_tests(code: str, who: str) -> list[dict[str, str]]:
    """One test per top-level assert of `code`; the other top-level statements prefix every test."""
    tree = ast.parse(code)
    setup = [ast.get_source_segment(code, node) or "" for node in tree.body if not isinstance(node, ast.Assert)]
    asserts = [ast.get_source_segment(code, node) or "" for node in tree.body if isinstance(node, ast.Assert)]
    if not asserts:
        raise ParseError(f"{who}: the python block has no top-level assert statement")
    prefix = "\n".join(setup)
    return [{"code": f"{prefix}\n{test}" if prefix else test} for test in asserts]


class CodeWorkflow(ParallelWorkflow):
    """Coder and tester act in parallel each turn (see `nodes/parallel.py`)."""

    agents = ("coder", "tester")
