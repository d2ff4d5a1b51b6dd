"""Math for a single agent: the baseline the reasoner + tool-user team (`envs.math`) is compared against.

The same problems and answer checking (math-verify equivalence) as `envs.math`, but one agent, "solo",
reasons in text with no tool and no teammate: its action is the reasoner's, {"answer": str,
"reasoning": str}, and the team reward is 1.0 when its answer is correct. It sees the problem and its own
last answer and reasoning (the team's observation without the tool-user's part), so a later turn can
revise. The episode ends when it gives an answer equivalent to its previous one (the solo form of the
team's rule, which ends the episode when the two teammates' answers agree), or when the workflow's
turns run out.
"""

from __future__ import annotations

from typing import Any

from envs.math import MathEnv
from envs.math_data import equivalent


class MathSoloEnv(MathEnv):
    """One reasoner, no tool: see the module docstring. Its answer is kept as `reasoner_answer`, so
    `team_reward()` and the reasoner's reward read it as they do for the team."""

    actions = {"solo": '{"answer": str, "reasoning": str}: its answer and a short excerpt of its reasoning'}
    rewards = (
        "team_reward() is 1.0 when its answer is correct, else 0.0; the episode ends when it gives an answer "
        "equivalent to its previous one"
    )
    info_keys = {"solo": {"correct": "its answer is correct"}}

    possible_agents = ["solo"]

    async def astep(self, agent: str, action: Any) -> None:
        """Record the answer; the episode ends when it repeats the previous one."""
        self._check(agent, action, ("answer", "reasoning"))
        previous = self.reasoner_answer
        self.reasoner_answer, self.reasoning = action["answer"], action["reasoning"]
        self.terminations = {"solo": previous is not None and equivalent(previous, self.reasoner_answer)}
        self.infos["solo"] = {"correct": self.correct(self.reasoner_answer)}

    def action_examples(self, agent: str) -> list[dict[str, str]]:
        """The right answer and a wrong one (for `envs.check.check_env`)."""
        self._check(agent, {}, ())
        if self.done:
            return []
        gold = self._problem()["answer"]
        return [{"answer": gold, "reasoning": "example"}, {"answer": "0", "reasoning": "example"}]
