"""Code for a single agent: the baseline the coder + tester team (`envs.code`) is compared against.

The same problems, datasets and sandbox as `envs.code`, but one agent, "solo", writes the program and
nobody writes tests: its action is the coder's (a program, str), run on the problem's hidden
ground-truth tests. `pass_ratio()` (the fraction of those tests passed) is the team reward, and the
episode ends once the program passes all of them, as the team's does. The observation is the coder's:
the task, the problem and the current program, never the ground-truth results.
"""

from __future__ import annotations

from typing import Any

from envs.code import CodeEnv


class CodeSoloEnv(CodeEnv):
    """One coder, no tester: see the module docstring."""

    actions = {"solo": "a program (str), run in the sandbox on the problem's hidden tests"}
    info_keys = {
        "solo": {
            "pass_ratio": "the fraction of hidden tests the current program passes",
            "test_agreement": "a diagnostic of the team's tester: no meaning without one",
        }
    }

    possible_agents = ["solo"]

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        super().reset(seed=seed, options=options)
        self.terminations = {"solo": False}
        self.truncations = {"solo": False}
        self.infos = {"solo": {}}

    def observe(self, agent: str) -> str:
        self._check(agent)
        return super().observe("coder")

    async def astep(self, agent: str, action: Any) -> None:
        """Run the program on the hidden tests; the episode ends when it passes every one."""
        self._check(agent)
        await super().astep("coder", action)
        self.terminations = {"solo": bool(self.ground_truth) and all(self.ground_truth)}
        self.infos = {"solo": self.infos["coder"]}

    def action_examples(self, agent: str) -> list[Any]:
        self._check(agent)
        return super().action_examples("coder")

    @staticmethod
    def _check(agent: str) -> None:
        if agent != "solo":
            raise ValueError(f"code_solo: unknown agent {agent!r}: the only agent is 'solo'")
