"""The `Workflow` base and the episode context it plays through (part of the framework API).

A `Workflow` is an async `run(episode)` that decides which node acts when. It sees the episode only
through `EpisodeContext`: `await episode.act(node)` is AT-GRPO's tree-sampling step (sample K, score each
candidate on its own env clone, record the group, commit the best); `sample`, `record`, `choose`,
`commit` and `next_turn` are the lower-level steps for parallel or routed workflows. The framework's
implementation is `mas_async.rollout.episode.Episode`; user code needs only this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from mas_async.api.env import Env
    from mas_async.api.node import Node


@dataclass(slots=True)
class Candidate:
    """One sampled action of one agent at one turn, scored on its own env clone.

    env: the candidate's own clone after its action (unchanged when the text did not parse); committing
    the candidate makes this very object the episode's env. reward = alpha * team_reward + local_reward.
    `completion` is the generated completion (token ids, log-probs, weight version); None when a
    reference policy chose the action (a baseline episode: nothing was generated). `quality` is the
    env's judgement of the move (`Env.move_quality`), None where the env has none.
    """

    agent: str
    policy: str
    turn: int
    index: int
    prompt_ids: np.ndarray
    completion: Any
    text: str
    action: Any
    valid: bool
    error: str | None
    env: Env
    team_reward: float
    local_reward: float
    reward: float
    quality: bool | None = None


class EpisodeContext(Protocol):
    """What a workflow may do with the episode it is given."""

    env: Env
    """The committed env (the chosen candidate's clone after each commit)."""
    turn: int
    mode: str
    """"train" (K candidates, samples recorded), "eval" (one candidate, greedy unless configured) or
    "baseline/<name>" (the env's reference policy <name> plays instead of the model; nothing recorded)."""
    k: int
    """Candidates per agent per turn in this episode (1 in eval mode)."""

    async def act(self, node: Node) -> Candidate:
        """Sample K candidates for `node`, score each on its own clone, record the group, commit the best."""
        ...

    async def sample(self, node: Node, n: int | None = None, greedy: bool | None = None) -> list[Candidate]:
        """`n` (default: the episode's K) candidates from one request, each scored on its own clone."""
        ...

    def record(self, node: Node, candidates: list[Candidate]) -> None: ...

    def choose(self, candidates: list[Candidate]) -> Candidate: ...

    def commit(self, candidate: Candidate) -> None: ...

    def next_turn(self) -> None: ...


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

    async def run(self, episode: EpisodeContext) -> None:
        """Play one episode: call `episode.act(node)` (or sample/record/commit) until it is over."""
        raise NotImplementedError
