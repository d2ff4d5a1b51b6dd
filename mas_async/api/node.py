"""The `Node` base: what a user writes to add an agent role (part of the framework API).

A `Node` is one agent role: it turns an observation into chat messages (`prompt`), the model's text into
an env action (`parse`, raising `ParseError` for anything invalid), and a transition into the role's
own dense reward (`local_reward`). Workflows (`mas_async.api.workflow`) decide which node acts when.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mas_async.api.env import Env


class ParseError(ValueError):
    """The model's text is not a valid action; the candidate is kept with the node's `invalid_penalty`."""


class Node:
    """One agent role, bound to the env agent it plays (`Node(agent)`).

    A subclass implements `parse`, and usually `local_reward`; `prompt` defaults to the observation as
    one user message. A toy node for the `Echo` env of `mas_async.api.env.Env`:

        class Speaker(Node):
            def prompt(self, obs):
                return [{"role": "user", "content": obs}]

            def parse(self, text):
                word = text.strip()
                if not word:
                    raise ParseError("empty answer")
                return word

            def local_reward(self, before, action, after):
                return 0.1 if action.isupper() else 0.0

        node = Speaker("speaker")
    """

    invalid_penalty: float = -1.0
    max_tokens: int | None = None
    """Most tokens of each reply of this role (None: the run's `rollout.max_tokens`, its upper bound; the
    config's `agents.<agent>.max_tokens` overrides it)."""

    def __init__(self, agent: str) -> None:
        self.agent = agent

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        """Chat messages for the policy's chat template. They may end with a partial assistant message (e.g.
        "Answer:"): the reply then continues it, and `parse` gets the text that follows it."""
        return [{"role": "user", "content": str(obs)}]

    def parse(self, text: str) -> Any:
        """The env action that `text` names; raise ParseError if there is none."""
        raise NotImplementedError

    def local_reward(self, before: Env, action: Any, after: Env) -> float:
        """This role's own reward for moving the env from `before` to `after` with `action`."""
        return 0.0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.agent!r})"
