"""The workflow kind whose program is a user's async function (`workflow.program: "module:function"`).

    async def play(task, agents, **options):
        reply = await agents["vertical"].chat.completions.create(
            model="vertical", messages=[{"role": "user", "content": task.observation["vertical"]}]
        )
        ...
        return {"team": 1.0, "local": {"vertical": 0.5}}

`task` is a `mas_async.gateway.episode.Task`, `agents` maps each agent to an `openai.AsyncOpenAI` client of
the env worker's gateway (the `model` of a call names the agent), `options` are `workflow.options`. The
program needs nothing from mas_async: any code written against the OpenAI API runs as it is.
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mas_async.gateway.episode import GatewayEpisode, Program


class ProgramError(ValueError):
    """`workflow.program` names nothing that can be run as a workflow program."""


def load_program(path: str) -> Program:
    """The async function that "module:function" names (an import error in the module is raised as is)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ProgramError(f"workflow.program is {path!r}: give it as 'module:function'")
    module = importlib.import_module(module_name)
    program = getattr(module, attr, None)
    if program is None:
        raise ProgramError(f"workflow.program {path!r}: module {module_name!r} has no attribute {attr!r}")
    if not inspect.iscoroutinefunction(program):
        raise ProgramError(f"workflow.program {path!r} is not an async function (async def {attr}(task, agents))")
    return program


class ProgramWorkflow:
    """Plays each episode by running the program (`GatewayEpisode.play`)."""

    def __init__(self, program: Program, options: dict[str, Any] | None = None) -> None:
        self.program = program
        self.options = dict(options or {})

    async def run(self, episode: GatewayEpisode) -> None:
        await episode.play(self.program, self.options)
