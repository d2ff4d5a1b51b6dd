"""The math tool team (Stronger-MAS's math team as a sequence): a tool user whose program the sandbox runs,
then a reasoner who reads its output and gives the final answer; and its single-agent variant.

`MathToolEnv` (agents "tool_user", "reasoner") is `envs.math.MathEnv` (the same actions, observations,
rewards and end: the answers agree), played by `nodes.math_tool.MathToolWorkflow` in that order each turn,
with the reference policies this team is measured against on the held-out problems (they need problems
with an "expression", as `envs.math_arith` makes; on others they raise a ValueError naming it):

- `always_0`: the tool user's program prints 0 and the reasoner answers 0 (a constant answer);
- `reference_tool`: the program is `print(<the problem's expression>)`, run in the sandbox, and the
  reasoner answers what it printed: the ceiling, a tool that is always right and a reasoner that copies it.

`MathToolSoloEnv` (agent "solo") is the single agent with the same tool: each round it writes a program
(action {"code"}, run in the sandbox as the tool user's), then, shown the output, answers (action
{"answer", "reasoning"}), in that order (`expects()`; the other kind of action is a ValueError). Its answer
is its \\boxed{} one (else its program's, as the team's falls back on the tool's); the episode ends when
the two agree, the team's rule. Its reference policies are the team's, played by the one agent.
"""

from __future__ import annotations

import random
from typing import Any

from envs.math import MathEnv
from mas_async.api import ReferencePolicy


def expression_of(env: MathEnv) -> str:
    """The problem's arithmetic expression (a ValueError when the problem has none)."""
    expression = env._problem().get("expression")
    if not isinstance(expression, str):
        raise ValueError(
            f"{type(env).__name__}: the reference tool needs problems with an 'expression' "
            "(env.options.dataset=arithmetic)"
        )
    return expression


def program_of(env: MathEnv) -> dict[str, str]:
    """The reference tool's action: a program that prints the expression's value."""
    return {"code": f"print({expression_of(env)})"}


def copy_tool(env: MathEnv) -> dict[str, str]:
    """An answer that repeats what the tool printed (0 when it printed nothing)."""
    return {"answer": env.tool_answer or "0", "reasoning": "the program's output"}


def zero(kind: str) -> dict[str, str]:
    return {"code": "print(0)"} if kind == "code" else {"answer": "0", "reasoning": "always 0"}


class MathToolEnv(MathEnv):
    """The tool user, then the reasoner; see the module docstring."""

    possible_agents = ["tool_user", "reasoner"]

    @classmethod
    def reference_policies(cls) -> dict[str, ReferencePolicy]:
        def always_0(env: MathEnv, agent: str, rng: random.Random) -> dict[str, str]:
            return zero("code" if agent == "tool_user" else "answer")

        def reference_tool(env: MathEnv, agent: str, rng: random.Random) -> dict[str, str]:
            return program_of(env) if agent == "tool_user" else copy_tool(env)

        return {"always_0": always_0, "reference_tool": reference_tool}


class MathToolSoloEnv(MathEnv):
    """One agent writes the program, reads its output and answers; see the module docstring."""

    possible_agents = ["solo"]
    actions = {
        "solo": 'as expects(): {"code": str}, a program run in the sandbox (its answer: the last line it '
        'printed), then {"answer": str, "reasoning": str}, its final answer; and again'
    }
    rewards = (
        "team_reward() is 1.0 when its answer (the final one, or its program's while it has none) is correct, "
        "else 0.0; the episode ends when the final answer and the program's agree"
    )
    info_keys = {"solo": {"correct": "its current answer is correct", "step": "the step played: code or answer"}}

    def expects(self) -> str:
        """The kind of action due now: "code" at the start of each round, "answer" after a program."""
        return "answer" if self._last == "code" else "code"

    def _reset_state(self) -> None:
        super()._reset_state()
        self._last = "answer"

    async def astep(self, agent: str, action: Any) -> None:
        """Run the program (as the tool user's) or record the answer (as the reasoner's), as due."""
        kind = self.expects()
        self._check(agent, action, ("code",) if kind == "code" else ("answer", "reasoning"))
        await super().astep("tool_user" if kind == "code" else "reasoner", action)
        self._last = kind
        self.terminations = {"solo": self.agreed()}
        self.infos = {"solo": {"correct": self.correct(self.team_answer()), "step": kind}}

    def _check(self, agent: str, action: Any, keys: tuple[str, ...]) -> None:
        # MathEnv.astep checks the team role it plays; the solo agent is checked here.
        if agent in ("tool_user", "reasoner"):
            agent = "solo"
        super()._check(agent, action, keys)

    def observe(self, agent: str) -> str:
        self._check(agent, {}, ())
        parts = [f"PROBLEM:\n{self._problem()['problem'].strip()}"]
        if self.tool_code is not None:
            parts.append(f"YOUR PROGRAM:\n```python\n{self.tool_code[:1500]}\n```")
            parts.append(f"ITS OUTPUT:\n{self.tool_output[-1500:]}")
        if self.reasoner_answer is not None:
            parts.append(f"YOUR LAST ANSWER: {self.reasoner_answer}")
        return "\n\n".join(parts)

    def answer_of(self, agent: str) -> str | None:
        return self.team_answer()

    def action_examples(self, agent: str) -> list[dict[str, str]]:
        """The right and a wrong action of the kind due now (for `envs.check.check_env`)."""
        self._check(agent, {}, ())
        if self.done:
            return []
        gold = self._problem()["answer"]
        if self.expects() == "code":
            return [{"code": f"print({gold!r})"}, zero("code")]
        return [{"answer": gold, "reasoning": "example"}, zero("answer")]

    @classmethod
    def reference_policies(cls) -> dict[str, ReferencePolicy]:
        def always_0(env: MathToolSoloEnv, agent: str, rng: random.Random) -> dict[str, str]:
            return zero(env.expects())

        def reference_tool(env: MathToolSoloEnv, agent: str, rng: random.Random) -> dict[str, str]:
            return program_of(env) if env.expects() == "code" else copy_tool(env)

        return {"always_0": always_0, "reference_tool": reference_tool}
