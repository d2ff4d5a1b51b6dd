"""Math: a reasoner and a tool-user (Python run in the sandbox) solve a problem; or a solver and a verifier.

`MathEnv` (agents "reasoner", "tool_user"; the paper's parallel workflow, `nodes/math.py`):

- the reasoner's action is {"answer": str, "reasoning": str} (its \\boxed{} answer and a short excerpt
  of its reasoning, shown to the tool-user next turn);
- the tool-user's action is {"code": str}: a program that `astep` runs in the sandbox; its answer is
  the last \\boxed{} in the program's stdout, else its last non-empty line (none if the run failed);
- each agent's local reward (`nodes/math.py`) is 1.0 when its own answer is correct, else 0.0;
- `team_reward()` is 1.0 when the team's answer (the reasoner's, or the tool-user's while the reasoner
  has none) is correct; the episode ends when both answers agree (math-verify equivalence).

`RoutedMathEnv` (agents "solver", "verifier"; the Dr. MAS-style routed workflow, `nodes/routed.py`):
the solver's action is {"answer", "reasoning"}; the verifier's is {"verdict": "approve" | "reject",
"feedback": str}. An approval ends the episode; a rejection goes back to the solver with the feedback.
The team reward is the correctness of the solver's current answer; the verifier's local reward is 1.0
when its verdict is right (approve a correct answer, reject a wrong one).

Correctness is `envs.math_data.equivalent` against the problem's answer (math-verify): numbers,
fractions, expressions and LaTeX, never string equality. Problems: the shipped splits (32 each, disjoint)
or `train_path` / `test_path` JSONL (AIME / OlympiadBench style); more than a dataset holds returns all.
Or a generated dataset, `env.options.dataset` (`DATASETS`): "arithmetic" (`envs/math_arith.py`, expressions
and word problems a program solves in one line, thousands of them, the test split disjoint by content).
Their "expression" is what the math tool team's reference policies use (`envs/math_tool.py`: a constant
answer, and the reference tool, a program that computes the expression, as the ceiling).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from envs.math_arith import arithmetic_problems, integer_answer
from envs.math_data import equivalent, last_boxed, load_jsonl, load_split
from mas_async.api import Env, Limits, RunCache, SandboxResult, check_split, run_python, run_sync

SHOWN_CHARS = 1500  # reasoning, code and output shown in an observation, at most
TOOL_LIMITS = Limits(timeout_s=10.0, cpu_s=5)
DATASETS: dict[str, Callable[..., list[dict[str, Any]]]] = {"arithmetic": arithmetic_problems}
"""Generated problem sets a config names as `env.options.dataset` (their options beside it)."""


class _MathBase(Env):
    """What both math envs share: problem handling, correctness, datasets, copies."""

    def __init__(self) -> None:
        self.problem: dict[str, Any] | None = None
        self.terminations, self.truncations, self.infos = {}, {}, {}

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """Start on `options["problem"]`, or on train problem `seed` (modulo the split's size)."""
        problem = (options or {}).get("problem")
        if problem is None:
            if seed is None:
                raise ValueError(f"{self._name()}: reset needs options={{'problem': dict}} or a seed")
            train = load_split("train")
            problem = train[seed % len(train)]
        if "problem" not in problem or "answer" not in problem:
            raise ValueError(f"{self._name()}: a problem dict needs 'problem' and 'answer', got {sorted(problem)}")
        self.problem = problem
        self.terminations = {agent: False for agent in self.possible_agents}
        self.truncations = {agent: False for agent in self.possible_agents}
        self.infos = {agent: {} for agent in self.possible_agents}
        self._reset_state()

    def _reset_state(self) -> None:
        raise NotImplementedError

    def correct(self, answer: str | None) -> bool:
        """Whether `answer` is equivalent to the problem's answer (for a problem whose `answer_form` is
        "integer", as the arithmetic ones: that integer written out, `envs.math_arith.integer_answer`)."""
        problem = self._problem()
        if problem.get("answer_form") == "integer":
            return integer_answer(problem["answer"], answer)
        return equivalent(problem["answer"], answer)

    def step(self, agent: str, action: Any) -> None:
        """Synchronous `astep` (PettingZoo); inside an event loop, await `astep` instead."""
        run_sync(lambda: self.astep(agent, action))

    async def astep(self, agent: str, action: Any) -> None:
        raise NotImplementedError

    def clone(self) -> _MathBase:
        # The problem is never mutated and the run cache is shared on purpose.
        return self.shallow_clone()

    @classmethod
    def problems(
        cls,
        split: str,
        count: int,
        train_path: str | None = None,
        test_path: str | None = None,
        dataset: str | None = None,
        **dataset_options: Any,
    ) -> list[dict[str, Any]]:
        """Up to `count` problems of `split`: the shipped ones, those of `train_path` / `test_path`, or
        those of a generated dataset of `DATASETS` (`dataset`, with its `dataset_options`)."""
        check_split(split, count)
        if dataset is not None:
            if dataset not in DATASETS:
                raise ValueError(
                    f"{cls.__name__}: env.options.dataset={dataset!r} names no dataset: known are "
                    f"{', '.join(sorted(DATASETS))} (or leave it out for the shipped problems)"
                )
            if train_path is not None or test_path is not None:
                raise ValueError(f"{cls.__name__}: give env.options.dataset or train_path/test_path, not both")
            return DATASETS[dataset](split, count, **dataset_options)
        if dataset_options:
            raise TypeError(f"{cls.__name__}: options {sorted(dataset_options)} need env.options.dataset")
        path = train_path if split == "train" else test_path
        return (load_split(split) if path is None else load_jsonl(path))[:count]

    def _problem(self) -> dict[str, Any]:
        if self.problem is None:
            raise ValueError(f"{self._name()}: call reset() before using the env")
        return self.problem

    def _check(self, agent: str, action: Any, keys: tuple[str, ...]) -> None:
        if agent not in self.possible_agents:
            raise ValueError(f"{self._name()}: unknown agent {agent!r}: agents are {', '.join(self.possible_agents)}")
        if not isinstance(action, dict) or any(not isinstance(action.get(k), str) for k in keys):
            raise TypeError(f"{self._name()}: {agent}'s action is a dict of strings {list(keys)}, got {action!r:.80}")

    def _name(self) -> str:
        return type(self).__name__


class MathEnv(_MathBase):
    """A reasoner and a tool-user answer in parallel; see the module docstring."""

    actions = {
        "reasoner": '{"answer": str, "reasoning": str}: its final answer and a short excerpt of its reasoning',
        "tool_user": '{"code": str}: a program run in the sandbox; its answer is the last \\boxed{} of its output, '
        "else its last non-empty line",
    }
    rewards = (
        "team_reward() is 1.0 when the team's answer (the reasoner's, or the tool-user's while the reasoner has "
        "none) is correct, else 0.0; the episode ends when both answers agree"
    )
    info_keys = {agent: {"correct": "its own answer is correct"} for agent in ("reasoner", "tool_user")}

    possible_agents = ["reasoner", "tool_user"]
    runs_code = True

    def _reset_state(self) -> None:
        self.reasoner_answer: str | None = None
        self.reasoning = ""
        self.tool_code: str | None = None
        self.tool_output = ""
        self.tool_answer: str | None = None
        self._runs = RunCache()

    def observe(self, agent: str) -> str:
        self._check(agent, {}, ())
        parts = [f"PROBLEM:\n{self._problem()['problem'].strip()}"]
        if self.reasoner_answer is not None:
            parts.append(f"REASONER ANSWER: {self.reasoner_answer}\nREASONING:\n{self.reasoning[-SHOWN_CHARS:]}")
        if self.tool_code is not None:
            parts.append(f"TOOL CODE:\n```python\n{self.tool_code[:SHOWN_CHARS]}\n```")
            parts.append(f"TOOL OUTPUT:\n{self.tool_output[-SHOWN_CHARS:]}\nTOOL ANSWER: {self.tool_answer}")
        if self.reasoner_answer is not None and self.tool_code is not None:
            parts.append("The two answers " + ("agree." if self.agreed() else "differ: find the mistake."))
        return "\n\n".join(parts)

    async def astep(self, agent: str, action: Any) -> None:
        """Record the reasoner's answer, or run the tool-user's program and read its answer."""
        if agent == "reasoner":
            self._check(agent, action, ("answer", "reasoning"))
            self.reasoner_answer, self.reasoning = action["answer"], action["reasoning"]
        else:
            self._check(agent, action, ("code",))
            code = action["code"]
            key = hashlib.sha256(code.encode()).hexdigest()
            result: SandboxResult = await self._runs.get(key, lambda: run_python(code, limits=TOOL_LIMITS))
            self.tool_code = code
            self.tool_output = (
                result.stdout if result.ok else f"{result.stdout}\n{result.stderr}\n[{result.status}: {result.detail}]"
            )
            self.tool_answer = tool_answer(result)
        done = self.agreed()
        self.terminations = {a: done for a in self.possible_agents}
        self.infos[agent] = {"correct": self.correct(self.answer_of(agent))}

    def action_examples(self, agent: str) -> list[dict[str, str]]:
        """Actions `agent` may play now (for `envs.check.check_env`): the right answer and a wrong one."""
        self._check(agent, {}, ())
        if self.done:
            return []
        gold = self._problem()["answer"]
        if agent == "reasoner":
            return [{"answer": gold, "reasoning": "example"}, {"answer": "0", "reasoning": "example"}]
        return [{"code": f"print({gold!r})"}, {"code": "print(0)"}]

    def answer_of(self, agent: str) -> str | None:
        return self.reasoner_answer if agent == "reasoner" else self.tool_answer

    def team_answer(self) -> str | None:
        return self.reasoner_answer if self.reasoner_answer is not None else self.tool_answer

    def agreed(self) -> bool:
        """Both agents have answered and their answers are equivalent."""
        a, b = self.reasoner_answer, self.tool_answer
        return a is not None and b is not None and equivalent(a, b)

    def team_reward(self) -> float:
        return 1.0 if self.correct(self.team_answer()) else 0.0


class RoutedMathEnv(_MathBase):
    """A solver answers, a verifier approves (the end) or rejects (back to the solver)."""

    actions = {
        "solver": '{"answer": str, "reasoning": str}: its answer and a short excerpt of its reasoning',
        "verifier": '{"verdict": "approve" | "reject", "feedback": str}: approve ends the episode, reject sends '
        "the feedback back to the solver",
    }
    rewards = (
        "team_reward() is 1.0 when the solver's current answer is correct, else 0.0; the episode ends at an "
        "approval (the verifier's local reward: 1.0 when its verdict is right, nodes/routed.py)"
    )
    info_keys = {
        agent: {"correct": "the solver's current answer is correct", "verdict": "the verifier's last verdict"}
        for agent in ("solver", "verifier")
    }

    possible_agents = ["solver", "verifier"]

    def _reset_state(self) -> None:
        self.answer: str | None = None
        self.reasoning = ""
        self.verdict: str | None = None
        self.feedback = ""

    def observe(self, agent: str) -> str:
        self._check(agent, {}, ())
        parts = [f"PROBLEM:\n{self._problem()['problem'].strip()}"]
        if self.answer is not None:
            parts.append(f"PROPOSED ANSWER: {self.answer}\nREASONING:\n{self.reasoning[-SHOWN_CHARS:]}")
        if self.verdict == "reject":
            parts.append(f"VERIFIER: rejected.\nFEEDBACK:\n{self.feedback[-SHOWN_CHARS:]}")
        return "\n\n".join(parts)

    async def astep(self, agent: str, action: Any) -> None:
        if agent == "solver":
            self._check(agent, action, ("answer", "reasoning"))
            self.answer, self.reasoning = action["answer"], action["reasoning"]
            self.verdict, self.feedback = None, ""
        else:
            self._check(agent, action, ("verdict", "feedback"))
            if action["verdict"] not in ("approve", "reject"):
                raise ValueError(f"RoutedMathEnv: a verdict is 'approve' or 'reject', got {action['verdict']!r}")
            self.verdict, self.feedback = action["verdict"], action["feedback"]
        done = self.verdict == "approve"
        self.terminations = {a: done for a in self.possible_agents}
        self.infos[agent] = {"correct": self.correct(self.answer), "verdict": self.verdict}

    def action_examples(self, agent: str) -> list[dict[str, str]]:
        """Actions `agent` may play now (for `envs.check.check_env`); the verifier needs an answer."""
        self._check(agent, {}, ())
        if self.done:
            return []
        if agent == "solver":
            gold = self._problem()["answer"]
            return [{"answer": gold, "reasoning": "example"}, {"answer": "0", "reasoning": "example"}]
        if self.answer is None:
            return []
        return [{"verdict": "approve", "feedback": ""}, {"verdict": "reject", "feedback": "check it"}]

    def verdict_right(self) -> bool:
        """The verifier approved a correct answer or rejected a wrong one."""
        if self.verdict is None:
            return False
        return (self.verdict == "approve") == self.correct(self.answer)

    def team_reward(self) -> float:
        return 1.0 if self.correct(self.answer) else 0.0


def tool_answer(result: SandboxResult) -> str | None:
    """The answer a tool run printed: its last \\boxed{}, else its last non-empty line; None on failure."""
    if not result.ok:
        return None
    boxed = last_boxed(result.stdout)
    if boxed is not None:
        return boxed
    lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    return lines[-1] if lines else None
