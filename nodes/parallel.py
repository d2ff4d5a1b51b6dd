"""The parallel workflow: every agent acts at once in each turn, on the same state.

The shape of the paper's code (coder + tester) and math (reasoner + tool-user) workflows. Each turn:

1. every agent samples its K candidates from the turn's starting state, concurrently (one request
   per agent, `episode.sample`); each candidate is scored on its own clone, so an agent's group
   compares its own candidates only;
2. each agent's candidates are recorded as its group and its best is chosen (`episode.choose`);
3. the chosen actions are joined into one env: the first agent's chosen clone, then every other
   agent's chosen action applied to it in agent order (an invalid choice applies nothing); the
   next turn starts from that env, so each agent sees what the others did this turn;
4. the episode ends when the env is done (e.g. the code passes the tests, the answers agree) or
   after `max_turns` turns.

A subclass only names its agents: `class MyTeam(ParallelWorkflow): agents = ("a", "b")`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from mas_async.api import Node, Workflow, step_env

if TYPE_CHECKING:
    from mas_async.api import EpisodeContext as Episode


class ParallelWorkflow(Workflow):
    """Agents act in parallel within a turn; see the module docstring."""

    def __init__(self, nodes: dict[str, Node], max_turns: int = 4) -> None:
        super().__init__(nodes)
        if not self.agents:
            raise ValueError(f"{type(self).__name__}: a parallel workflow must name its agents")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"{type(self).__name__}: max_turns must be a positive integer, got {max_turns!r}")
        self.max_turns = max_turns

    async def run(self, episode: Episode) -> None:
        nodes = [self.nodes[agent] for agent in self.agents]
        for _ in range(self.max_turns):
            if episode.env.done:
                return
            groups = await asyncio.gather(*(episode.sample(node) for node in nodes))
            chosen = []
            for node, candidates in zip(nodes, groups, strict=True):
                episode.record(node, candidates)
                chosen.append(episode.choose(candidates))
            joined = chosen[0].env.clone()
            for candidate in chosen[1:]:
                if candidate.valid:
                    await step_env(joined, candidate.agent, candidate.action)
            for candidate in chosen:
                episode.commit(candidate)
            episode.env = joined  # every agent's chosen action, not only the last committed branch
            episode.next_turn()
