"""The workflow kind whose program is a user's async function (`workflow.program: "module:function"`).

    async def play(task, agents, **options):
        reply = await agents["vertical"].chat.completions.create(
            model="vertical", messages=[{"role": "user", "content": task.observation["vertical"]}]
        )
        ...
        return {"team": 1.0, "local": {"vertical": 0.5}}

`task` is a `mas_async.gateway.episode.Task`, `agents` maps each agent to an `openai.AsyncOpenAI` client of
the env worker's gateway (the `model` of a call names the agent), `options` are `workflow.options`. The
program needs nothing from mas_async: any code written against the OpenAI API runs as it is. Under
`algorithm.sampling: tree` the run also names a scorer (`workflow.scorer`, `load_scorer`), which picks the
best of K candidates of each training call (`tree.py`).
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mas_async.gateway.episode import GatewayEpisode, Program
    from mas_async.gateway.tree import Scorer


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


class ProgramWorkflow:
    """Plays each episode by running the program (`GatewayEpisode.play`)."""

    def __init__(self, program: Program, options: dict[str, Any] | None = None) -> None:
        self.program = program
        self.options = dict(options or {})

    async def run(self, episode: GatewayEpisode) -> None:
        await episode.play(self.program, self.options)
