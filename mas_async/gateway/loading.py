"""Loading a workflow program and its scorer from their "module:function" paths (`workflow.program`,
`workflow.scorer`).

This module sits below everything else in the gateway: the server loads the scorer of a tree-sampled run
here, the env worker loads the program here, and neither the episode nor the server is imported by it, so
the gateway's modules import one way only (loading <- server <- in_process <- episode <- workflow).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mas_async.gateway.tree import Scorer

__all__ = ["Program", "ProgramError", "load_program", "load_scorer"]

Program = Callable[..., Awaitable[Any]]
"""async def program(task: Task, agents: dict[str, openai.AsyncOpenAI], **options) -> rewards."""


class ProgramError(ValueError):
    """`workflow.program` (or `workflow.scorer`) names nothing that can be run as one."""


def load_program(path: str) -> Program:
    """The async function that "module:function" names (an import error in the module is raised as is)."""
    return _async_function(path, "workflow.program", "(task, agents)")


def load_scorer(path: str) -> Scorer:
    """The async function that `workflow.scorer` names: `async def score(task, agent, messages, choice) ->
    float`, which scores each candidate of a tree-sampled call (`tree.py`)."""
    return _async_function(path, "workflow.scorer", "(task, agent, messages, choice)")


def _async_function(path: str, key: str, signature: str) -> Any:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ProgramError(f"{key} is {path!r}: give it as 'module:function'")
    module = importlib.import_module(module_name)
    function = getattr(module, attr, None)
    if function is None:
        raise ProgramError(f"{key} {path!r}: module {module_name!r} has no attribute {attr!r}")
    if not inspect.iscoroutinefunction(function):
        raise ProgramError(f"{key} {path!r} is not an async function (async def {attr}{signature})")
    return function
