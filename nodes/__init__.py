"""Agent roles (workflow nodes) and the workflows that orchestrate them. Their registry keys live in
`mas_async.api.registry` (NODES, WORKFLOWS, re-exported here); a user's own node or workflow plugs in by
"module:Class" path."""

from __future__ import annotations

from mas_async.api import NODES, WORKFLOWS

__all__ = ["NODES", "WORKFLOWS"]
