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
best of K candidates of each training call (`tree.py`). The loaders live in `loading.py`, below the server,
which loads the scorer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mas_async.gateway.loading import Program, ProgramError, load_program, load_scorer
from mas_async.gateway.sdk_logs import quiet_sdk_errors

if TYPE_CHECKING:
    from mas_async.gateway.episode import GatewayEpisode

__all__ = ["Program", "ProgramError", "ProgramWorkflow", "load_program", "load_scorer"]


class ProgramWorkflow:
    """Plays each episode by running the program (`GatewayEpisode.play`)."""

    def __init__(self, program: Program, options: dict[str, Any] | None = None) -> None:
        self.program = program
        self.options = dict(options or {})
        quiet_sdk_errors()  # (an Agents SDK program's cut replies: one warning, not an error per call)

    async def run(self, episode: GatewayEpisode) -> None:
        await episode.play(self.program, self.options)
