"""Run a program against tests in the sandbox and say which passed (for `envs/code.py`).

`await run_tests(program, tests)` returns one bool per test, never raises for what the program does.

- Function tests ({"code": ...}) run in ONE sandbox run: a small harness execs the program in a fresh
  namespace (as module `__solution__`, so an `if __name__ == "__main__":` block does not run), then
  each test in a copy of that namespace, each under its own alarm (`per_test_s`), and reports every
  result as soon as it is known on a duplicate of stdout, tagged with a random nonce: a program that
  prints, exits early or hangs in test 3 still gets tests 0-2 counted, and its own prints cannot be
  mistaken for results by accident. (The program runs in the same process as the harness and could
  read the nonce; the sandbox contains it, but a reward computed here trusts it not to forge results.)
- Stdin tests ({"input", "output"}) run one sandbox run each, concurrently; a test passes when the
  program exits 0 and its stdout equals the expected output up to trailing whitespace on each line
  and trailing blank lines.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from typing import Any

from envs.sandbox import Limits, run_python

HARNESS = """\
import os as _os, signal as _signal
_fd = _os.dup(1)
class _TestTimeout(BaseException):
    pass
def _alarm(signum, frame):
    raise _TestTimeout()
def _report(what):
    _os.write(_fd, ("\\n%s %s\\n" % ({nonce!r}, what)).encode())
_signal.signal(_signal.SIGALRM, _alarm)
_namespace = {{"__name__": "__solution__"}}
try:
    _signal.setitimer(_signal.ITIMER_REAL, {per_test_s!r})
    exec(compile({program!r}, "solution.py", "exec"), _namespace)
    _signal.setitimer(_signal.ITIMER_REAL, 0)
except BaseException as _error:
    _report("load " + type(_error).__name__)
    _os._exit(0)
for _index, _test in enumerate({tests!r}):
    _signal.setitimer(_signal.ITIMER_REAL, {per_test_s!r})
    try:
        exec(compile(_test, "test_%d.py" % _index, "exec"), dict(_namespace))
        _passed = 1
    except BaseException:
        _passed = 0
    _signal.setitimer(_signal.ITIMER_REAL, 0)
    _report("%d %d" % (_index, _passed))
_os._exit(0)
"""


def is_function_test(test: dict[str, Any]) -> bool:
    return "code" in test


async def run_tests(
    program: str, tests: list[dict[str, Any]], *, per_test_s: float = 2.0, limits: Limits | None = None
) -> list[bool]:
    """One pass/fail per test (all function tests or all stdin tests) for `program`."""
    if not tests:
        return []
    kinds = {is_function_test(t) for t in tests}
    if len(kinds) > 1:
        raise ValueError("run_tests: a problem's tests are all function tests or all stdin tests, not both")
    if kinds == {True}:
        return await _function_tests(program, [t["code"] for t in tests], per_test_s, limits)
    runs = [_stdin_test(program, t["input"], t["output"], per_test_s, limits) for t in tests]
    return list(await asyncio.gather(*runs))


async def _function_tests(program: str, tests: list[str], per_test_s: float, limits: Limits | None) -> list[bool]:
    nonce = secrets.token_hex(8)
    harness = HARNESS.format(nonce=nonce, per_test_s=float(per_test_s), program=program, tests=tests)
    limits = limits or Limits(
        timeout_s=per_test_s * (len(tests) + 1) + 5.0, cpu_s=int(per_test_s * (len(tests) + 1)) + 5
    )
    result = await run_python(harness, limits=limits)
    passed = [False] * len(tests)
    for index, ok in re.findall(rf"^{nonce} (\d+) ([01])$", result.stdout, flags=re.MULTILINE):
        if int(index) < len(tests):
            passed[int(index)] = ok == "1"
    return passed


async def _stdin_test(program: str, given: str, expected: str, per_test_s: float, limits: Limits | None) -> bool:
    limits = limits or Limits(timeout_s=per_test_s + 3.0, cpu_s=int(per_test_s) + 1)
    result = await run_python(program, stdin=given, limits=limits)
    return result.ok and normalise_output(result.stdout) == normalise_output(expected)


def normalise_output(text: str) -> str:
    """Trailing whitespace of every line and trailing blank lines do not count."""
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).rstrip()
