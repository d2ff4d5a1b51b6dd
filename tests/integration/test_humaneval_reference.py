"""All 164 HumanEval reference solutions pass their own tests in the sandbox (run concurrently), and a
stub that returns None passes none: the code env's test split is sound and its judge (record the
program's answers in one sandbox run, judge them in another) is fair."""

from __future__ import annotations

import asyncio

from envs.code_data import load_humaneval
from mas_async.api import run_tests


def _judged(problem: dict) -> dict:
    return {"entry_point": problem["entry_point"], "prompt": problem["prompt"]}


def test_every_reference_solution_passes_its_tests() -> None:
    problems = load_humaneval()

    async def main() -> tuple[list[list[bool]], list[list[bool]]]:
        # A generous per-test alarm: 164 programs share the machine's cores.
        right = [run_tests(p["solution"], p["tests"], per_test_s=30.0, **_judged(p)) for p in problems]
        stubs = [
            run_tests(p["prompt"] + "    return None\n", p["tests"], per_test_s=30.0, **_judged(p)) for p in problems
        ]
        return await asyncio.gather(*right), await asyncio.gather(*stubs)

    right, stubs = asyncio.run(main())
    assert len(problems) == 164
    failed = [p["id"] for p, passed in zip(problems, right, strict=True) if not all(passed)]
    assert not failed, f"reference solutions failing their own tests: {failed}"
    assert not [p["id"] for p, passed in zip(problems, stubs, strict=True) if all(passed)]
