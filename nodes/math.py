"""Nodes and workflow for the math env (`envs/math.py`): a reasoner and a tool-user act in parallel.

- `Reasoner`: reasons in text and ends with \\boxed{answer}; its action is {"answer", "reasoning"}
  (the reasoning, after any thinking block, is shown to the tool-user next turn).
- `ToolUser`: writes one ```python program that prints the answer on its last line (or as \\boxed{});
  the env runs it in the sandbox; its action is {"code"}.
- Local reward of each: 1.0 when its own answer is correct (math-verify equivalence), else 0.0; the
  team reward is the correctness of the team's answer; the episode ends when the two answers agree.
- `MathWorkflow`: the parallel workflow (`nodes/parallel.py`) over ("reasoner", "tool_user").

No \\boxed{} answer, or no parsable code block, is a ParseError: kept with the penalty, never dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mas_async.api import Node
from nodes.parallel import ParallelWorkflow
from nodes.parsing import boxed_answer, python_block, strip_thinking

if TYPE_CHECKING:
    from envs.math import MathEnv

REASONING_CHARS = 1500  # of the reasoner's text kept for its teammate

REASONER_SYSTEM = """You are the reasoner in a team of two solving a math problem; your teammate solves it
by writing and running a Python program. Reason step by step. When your teammate's code, output or
answer is shown, check it against your own reasoning and correct whichever is wrong.
End with your final answer, simplified, as \\boxed{ANSWER}."""

TOOL_USER_SYSTEM = """You are the tool user in a team of two solving a math problem; your teammate reasons
in text. Write ONE ```python program (the standard library and sympy are available; no network, no
input) that computes the answer exactly and prints it on its last line, e.g. print(answer). When
your teammate's reasoning or answer is shown, use it to check your program."""


class Reasoner(Node):
    """Solves in text, answers in \\boxed{} (see the module docstring)."""

    def __init__(self, agent: str = "reasoner") -> None:
        super().__init__(agent)

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        return [{"role": "system", "content": REASONER_SYSTEM}, {"role": "user", "content": str(obs)}]

    def parse(self, text: str) -> dict[str, str]:
        answer = boxed_answer(text, self.agent)
        return {"answer": answer, "reasoning": strip_thinking(text).strip()[-REASONING_CHARS:]}

    def local_reward(self, before: MathEnv, action: Any, after: MathEnv) -> float:
        return 1.0 if after.correct(after.reasoner_answer) else 0.0


class ToolUser(Node):
    """Solves with a Python program run in the sandbox (see the module docstring)."""

    def __init__(self, agent: str = "tool_user") -> None:
        super().__init__(agent)

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        return [{"role": "system", "content": TOOL_USER_SYSTEM}, {"role": "user", "content": str(obs)}]

    def parse(self, text: str) -> dict[str, str]:
        return {"code": python_block(text, self.agent)}

    def local_reward(self, before: MathEnv, action: Any, after: MathEnv) -> float:
        return 1.0 if after.correct(after.tool_answer) else 0.0


class MathWorkflow(ParallelWorkflow):
    """Reasoner and tool-user act in parallel each turn (see `nodes/parallel.py`)."""

    agents = ("reasoner", "tool_user")
