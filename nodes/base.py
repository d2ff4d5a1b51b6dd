"""`nodes.base` is where the Node and Workflow bases lived; they are in `mas_async.api` now (kept
importable here)."""

from mas_async.api import Node, ParseError, Workflow

__all__ = ["Node", "ParseError", "Workflow"]
