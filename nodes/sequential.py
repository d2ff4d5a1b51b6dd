"""The sequential workflow: each turn the agents act one after another, each on the state the previous
agent's committed move left, until the env is done or `max_turns` turns have passed.

A subclass only names its agents (in turn order) and, if it likes, another default for `max_turns`:

    class Relay(SequentialWorkflow):
        agents = ("first", "second")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mas_async.api import Node, Workflow

if TYPE_CHECKING:
    from mas_async.api import EpisodeContext as Episode


class SequentialWorkflow(Workflow):
    def __init__(self, nodes: dict[str, Node], max_turns: int = 8) -> None:
        super().__init__(nodes)
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"{type(self).__name__}: max_turns must be a positive integer, got {max_turns!r}")
        self.max_turns = max_turns

    async def run(self, episode: Episode) -> None:
        for _ in range(self.max_turns):
            for agent in self.agents:
                if episode.env.done:
                    return
                await episode.act(self.nodes[agent])
            episode.next_turn()
