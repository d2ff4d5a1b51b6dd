"""The routed workflow (Dr. MAS style): a solver answers, a verifier approves or rejects; a rejection
routes back to the solver, with the verifier's feedback, until an approval or `max_turns` turns.

For the routed math env (`envs.math:RoutedMathEnv`):

- `Solver`: reasons and ends with \\boxed{answer}; action {"answer", "reasoning"}; local reward 1.0
  when its answer is correct, else 0.0.
- `Verifier`: checks the proposed answer and ends with a line `VERDICT: APPROVE` or `VERDICT: REJECT`
  (the text before it is the feedback); action {"verdict", "feedback"}; local reward 1.0 when the
  verdict is right (approves a correct answer or rejects a wrong one), else 0.0.

An answer without \\boxed{} or without a verdict line is a ParseError: kept with the penalty. An invalid
verdict that is committed changes nothing, so the workflow goes back to the solver as on a rejection.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from mas_async.api import Node, ParseError, Workflow
from nodes.parsing import boxed_answer, strip_thinking

if TYPE_CHECKING:
    from envs.math import RoutedMathEnv
    from mas_async.api import EpisodeContext as Episode

VERDICT = re.compile(r"VERDICT:\s*\**\s*(APPROVE|REJECT)", re.IGNORECASE)
SHOWN_CHARS = 1500

SOLVER_SYSTEM = """You are the solver in a team of two: you solve the math problem, a verifier checks your
answer. Reason step by step; if the verifier rejected your previous answer, use its feedback.
End with your final answer, simplified, as \\boxed{ANSWER}."""

VERIFIER_SYSTEM = """You are the verifier in a team of two: a solver proposes an answer to a math problem,
you check it. Solve or check the problem independently, step by step, and explain any mistake you find.
End with exactly one line: VERDICT: APPROVE if the proposed answer is correct, or VERDICT: REJECT."""


class Solver(Node):
    """Proposes an answer (see the module docstring)."""

    def __init__(self, agent: str = "solver") -> None:
        super().__init__(agent)

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        return [{"role": "system", "content": SOLVER_SYSTEM}, {"role": "user", "content": str(obs)}]

    def parse(self, text: str) -> dict[str, str]:
        answer = boxed_answer(text, self.agent)
        return {"answer": answer, "reasoning": strip_thinking(text).strip()[-SHOWN_CHARS:]}

    def local_reward(self, before: RoutedMathEnv, action: Any, after: RoutedMathEnv) -> float:
        return 1.0 if after.correct(after.answer) else 0.0


class Verifier(Node):
    """Approves or rejects the proposed answer (see the module docstring)."""

    def __init__(self, agent: str = "verifier") -> None:
        super().__init__(agent)

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        return [{"role": "system", "content": VERIFIER_SYSTEM}, {"role": "user", "content": str(obs)}]

    def parse(self, text: str) -> dict[str, str]:
        body = strip_thinking(text)
        matches = list(VERDICT.finditer(body))
        if not matches:
            raise ParseError(f"{self.agent}: no 'VERDICT: APPROVE' or 'VERDICT: REJECT' line")
        last = matches[-1]
        return {"verdict": last.group(1).lower(), "feedback": body[: last.start()].strip()[-SHOWN_CHARS:]}

    def local_reward(self, before: RoutedMathEnv, action: Any, after: RoutedMathEnv) -> float:
        return 1.0 if after.verdict_right() else 0.0


class RoutedWorkflow(Workflow):
    """Solver, then verifier; an approval ends the episode, a rejection routes back to the solver."""

    agents = ("solver", "verifier")

    def __init__(self, nodes: dict[str, Node], max_turns: int = 4) -> None:
        super().__init__(nodes)
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"RoutedWorkflow: max_turns must be a positive integer, got {max_turns!r}")
        self.max_turns = max_turns

    async def run(self, episode: Episode) -> None:
        for _ in range(self.max_turns):
            await episode.act(self.nodes["solver"])
            await episode.act(self.nodes["verifier"])
            if episode.env.done:  # approved
                return
            episode.next_turn()  # rejected (or no valid verdict): back to the solver
