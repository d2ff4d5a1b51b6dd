"""Judge a program against unit tests outside the program's process (for the code env).

`await run_tests(program, tests, entry_point=..., prompt=...)` returns one bool per test and never
raises for what the program does.

- Function tests ({"code": ...}) take two sandbox runs (`harness.py`). The first holds the program:
  it runs each test with the tests' asserts cut down to the calls they make (`calls_only`: no
  expected value is in that process) and sends, as data, what each call of the entry point returned
  or raised. The second holds no program: it runs the original tests against a replay of those
  answers and gives the verdicts. A program can then only choose what its functions return; it
  cannot report a result, reach the process that judges it, or read the values it is judged against.
  Tests may call helpers that the problem's `prompt` defines (HumanEval's `encode_cyclic`); the
  judge has the prompt's definitions, not the program's.
- `run_tests_on_constant(value, ...)`: the verdicts for a program whose entry point returns `value`
  for every call (a class: every method), without running one: the judge answers with `value`.
- Stdin tests ({"input", "output"}) run one sandbox run each, concurrently; the program's stdout is
  compared here: a test passes when the program exits 0 and its stdout equals the expected output up
  to trailing whitespace on each line and trailing blank lines.
"""

from __future__ import annotations

import ast
import asyncio
import json
import secrets
from pathlib import Path
from typing import Any

from mas_async.sandbox.result import Limits
from mas_async.sandbox.runner import run_python

HARNESS = Path(__file__).with_name("harness.py").read_text()


def is_function_test(test: dict[str, Any]) -> bool:
    return "code" in test


async def run_tests(
    program: str,
    tests: list[dict[str, Any]],
    *,
    entry_point: str = "",
    prompt: str = "",
    per_test_s: float = 2.0,
    limits: Limits | None = None,
) -> list[bool]:
    """One pass/fail per test (all function tests, which need `entry_point`, or all stdin tests)."""
    if not tests:
        return []
    if _kind(tests) == "function":
        recordings = await _record(program, [t["code"] for t in tests], entry_point, per_test_s, limits)
        if recordings is None:
            return [False] * len(tests)
        return await _judge(tests, entry_point, prompt, per_test_s, recordings=recordings)
    runs = [_stdin_test(program, t["input"], t["output"], per_test_s, limits) for t in tests]
    return list(await asyncio.gather(*runs))


async def run_tests_on_constant(
    value: Any, tests: list[dict[str, Any]], *, entry_point: str = "", prompt: str = "", per_test_s: float = 2.0
) -> list[bool]:
    """The verdicts for an entry point that returns `value` for every call (a stdin program: prints it)."""
    if not tests:
        return []
    if _kind(tests) == "function":
        return await _judge(tests, entry_point, prompt, per_test_s, constant=value)
    shown = normalise_output(str(value))
    return [normalise_output(t["output"]) == shown for t in tests]


def _kind(tests: list[dict[str, Any]]) -> str:
    kinds = {is_function_test(t) for t in tests}
    if len(kinds) > 1:
        raise ValueError("run_tests: a problem's tests are all function tests or all stdin tests, not both")
    return "function" if kinds == {True} else "stdin"


def calls_only(code: str) -> str:
    """`code` with every assert cut down to the calls it makes: `assert f(3) == 14` becomes `(f(3),)`,
    `assert abs(f(x) - 0.5) < 1e-6` becomes `(abs(f(x) - 0.5),)`. Comparison operands without a call
    (the expected values) are left out; and/or operands are all evaluated (the judge's replay takes
    the answers it needs). Code that does not parse is returned as it is (it fails either way)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code
    return ast.unparse(ast.fix_missing_locations(_CallsOnly().visit(tree)))


class _CallsOnly(ast.NodeTransformer):
    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        return ast.copy_location(ast.Expr(_calls(node.test)), node)


def _calls(expr: ast.expr) -> ast.expr:
    if isinstance(expr, ast.Compare):
        operands = [operand for operand in (expr.left, *expr.comparators) if _has_call(operand)]
        return ast.Tuple([_calls(operand) for operand in operands], ast.Load())
    if isinstance(expr, ast.BoolOp):
        return ast.Tuple([_calls(value) for value in expr.values], ast.Load())
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        return _calls(expr.operand)
    return expr


def _has_call(expr: ast.expr) -> bool:
    return any(isinstance(node, ast.Call) for node in ast.walk(expr))


def _limits(per_test_s: float, count: int) -> Limits:
    return Limits(timeout_s=per_test_s * (count + 1) + 5.0, cpu_s=int(per_test_s * (count + 1)) + 5)


async def _record(
    program: str, tests: list[str], entry: str, per_test_s: float, limits: Limits | None
) -> list[list] | None:
    """What each test's calls of the entry point did, per test; None when the program did not load."""
    if not entry:
        raise ValueError("run_tests: function tests need the problem's entry_point")
    nonce = secrets.token_hex(8)
    job = {"mode": "record", "nonce": nonce, "program": program, "entry": entry, "per_test_s": float(per_test_s)}
    job["tests"] = [calls_only(t) for t in tests]
    result = await run_python(
        HARNESS, files={"job.json": json.dumps(job)}, limits=limits or _limits(per_test_s, len(tests))
    )
    recordings: list[list] = [[] for _ in tests]
    for message in _messages(result.stdout, nonce):
        if "load" in message:
            return None
        index = message.get("test")
        if isinstance(index, int) and 0 <= index < len(tests) and isinstance(message.get("calls"), list):
            recordings[index] = message["calls"]
    return recordings


async def _judge(
    tests: list[dict[str, Any]],
    entry: str,
    prompt: str,
    per_test_s: float,
    recordings: list[list] | None = None,
    constant: Any = None,
) -> list[bool]:
    nonce = secrets.token_hex(8)
    job = {"mode": "judge", "nonce": nonce, "tests": [t["code"] for t in tests], "entry": entry, "prompt": prompt}
    job |= {"per_test_s": float(per_test_s), "recordings": recordings, "entry_is_class": entry[:1].isupper()}
    if recordings is None:
        from mas_async.sandbox.harness import encode

        job["constant"] = [encode(constant)]
    result = await run_python(HARNESS, files={"job.json": json.dumps(job)}, limits=_limits(per_test_s, len(tests)))
    passed = [False] * len(tests)
    for message in _messages(result.stdout, nonce):
        index = message.get("test")
        if isinstance(index, int) and 0 <= index < len(tests):
            passed[index] = message.get("passed") is True
    return passed


def _messages(stdout: str, nonce: str) -> list[dict]:
    found = []
    for line in stdout.splitlines():
        if line.startswith(nonce + " "):
            try:
                message = json.loads(line[len(nonce) + 1 :])
            except json.JSONDecodeError:
                continue
            if isinstance(message, dict):
                found.append(message)
    return found


async def _stdin_test(program: str, given: str, expected: str, per_test_s: float, limits: Limits | None) -> bool:
    limits = limits or Limits(timeout_s=per_test_s + 3.0, cpu_s=int(per_test_s) + 1)
    result = await run_python(program, stdin=given, limits=limits)
    return result.ok and normalise_output(result.stdout) == normalise_output(expected)


def normalise_output(text: str) -> str:
    """Trailing whitespace of every line and trailing blank lines do not count."""
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).rstrip()
