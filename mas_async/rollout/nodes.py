"""The nodes that play a run's agents, built from its config (`agents.<agent>.node`, `.max_tokens`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mas_async.api.registry import NODES, resolve

if TYPE_CHECKING:
    from mas_async.api.node import Node
    from mas_async.config import Config


def build_nodes(config: Config) -> dict[str, Node]:
    """agent -> its node, with the config's `max_tokens` where it gives one (the node's own otherwise)."""
    nodes = {}
    for agent, spec in config.agents.items():
        node = resolve(spec.node, NODES, "node")(agent)
        if spec.max_tokens is not None:
            node.max_tokens = spec.max_tokens
        nodes[agent] = node
    return nodes
