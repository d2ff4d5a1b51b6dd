"""The `Node` and `Workflow` bases: what a user writes to add an agent role or a way for agents to play.

A `Node` is one agent role: it turns an observation into chat messages (`prompt`), the model's text into
an env action (`parse`, raising `ParseError` for anything invalid), and a transition into the role's
own dense reward (`local_reward`). A `Workflow` is an async `run(episode)` that decides who acts when,
through the episode context (`mas_async.episode.Episode`): `await episode.act(node)` samples K
candidates, scores each on its own env clone, records the group and continues from the best one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from envs.base import Env
    from mas_async.episode import Episode


class ParseError(ValueError):
    """The model's text is not a valid action; the candidate is kept with the node's `invalid_penalty`."""


class Node:
    """One agent role, bound to the env agent it plays (`Node(agent)`).

    A subclass implements `parse`, and usually `local_reward`; `prompt` defaults to the observation as
    one user message. A toy node for the `Echo` env of `envs.base.Env`:

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

    def __init__(self, agent: str) -> None:
        self.agent = agent

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        """Chat messages for the policy's chat template."""
        return [{"role": "user", "content": str(obs)}]

    def parse(self, text: str) -> Any:
        """The env action that `text` names; raise ParseError if there is none."""
        raise NotImplementedError

    def local_reward(self, before: Env, action: Any, after: Env) -> float:
        """This role's own reward for moving the env from `before` to `after` with `action`."""
        return 0.0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.agent!r})"


class Workflow:
    """How the nodes of a team take turns on an episode: `Workflow(nodes, **options)`, `await run(episode)`.

    `nodes` maps each env agent to the node that plays it; a subclass lists the agents it needs in
    `agents` and takes its options as keyword arguments. A toy workflow for the `Echo` env:

        class SayOnce(Workflow):
            agents = ("speaker",)

            async def run(self, episode):
                await episode.act(self.nodes["speaker"])

        workflow = SayOnce({"speaker": Speaker("speaker")})
    """

    agents: tuple[str, ...] = ()

    def __init__(self, nodes: dict[str, Node], **options: Any) -> None:
        name = type(self).__name__
        if options:
            raise TypeError(f"{name}: unknown option(s) {', '.join(sorted(options))}")
        missing = [agent for agent in self.agents if agent not in nodes]
        if missing:
            given = ", ".join(sorted(nodes)) or "(none)"
            raise ValueError(f"{name} needs a node for agent(s) {', '.join(missing)}; got nodes for {given}")
        for agent, node in nodes.items():
            if node.agent != agent:
                raise ValueError(f"{name}: the node given for agent {agent!r} plays {node.agent!r}")
        self.nodes = dict(nodes)

    async def run(self, episode: Episode) -> None:
        """Play one episode: call `episode.act(node)` (or sample/record/commit) until it is over."""
        raise NotImplementedError
