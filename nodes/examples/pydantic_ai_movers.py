"""Plan-Path's two movers written with pydantic-ai: two `Agent` objects with a tool, on pydantic-ai's
`OpenAIResponsesModel` (the Responses API), trained on-policy through the gateway.

    workflow: {program: "nodes.examples.pydantic_ai_movers:play", options: {max_turns: 6}}

Each mover is a `pydantic_ai.Agent` whose model is `OpenAIResponsesModel(<agent>, provider=OpenAIProvider(
openai_client=<the run's client of that agent>))`, with one tool, `move(direction)`, that plays a move on
the episode's env. Every round both movers see the grid as it is and take their turn concurrently (as in
agents_sdk_movers.py); each keeps its own conversation (`result.all_messages()`), passed back as
`message_history` with the new grid, so every call after a mover's first resends its history and the gateway
reuses the exact token ids of its earlier turns. pydantic-ai runs the tool when the model calls it and calls
the model again with the result; a mover that answers with text instead has that text played as its move.
The run's sampling settings come from the task (`task.sampling`).

A reply that pydantic-ai cannot use (an empty one: with `retries=0` it does not ask again) loses that mover's
move (-1), and the team stops after the round. Rewards as agents_sdk_movers.py's: the env's team reward, and
each mover's mean progress. configs/examples/pydantic_ai_movers.yaml trains it on a built-in
CPU model.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from pydantic_ai import Agent, RunContext
from pydantic_ai.exceptions import AgentRunError, UnexpectedModelBehavior
from pydantic_ai.models.openai import OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

from nodes.examples.agents_sdk_movers import INSTRUCTIONS, MOVES, Mover

if TYPE_CHECKING:
    from openai import AsyncOpenAI


async def move(ctx: RunContext[Mover], direction: str) -> str:
    """Move the token one cell.

    Args:
        direction: U or D for the vertical mover, L or R for the horizontal one.
    """
    return ctx.deps.play(direction)


async def play(task: Any, agents: dict[str, AsyncOpenAI], max_turns: int = 6) -> dict[str, Any]:
    env = task.env  # Plan-Path: observe(agent), step(agent, move), distance(), done, infos
    settings = ModelSettings(temperature=task.sampling.temperature, max_tokens=task.sampling.max_tokens)
    team = {
        name: Agent(
            OpenAIResponsesModel(name, provider=OpenAIProvider(openai_client=agents[name])),
            instructions=INSTRUCTIONS[name],
            deps_type=Mover,
            tools=[move],
            model_settings=settings,
            retries=0,  # a retried call would be another sample of the same turn
        )
        for name in MOVES
    }
    movers = {name: Mover(env, name) for name in MOVES}
    histories: dict[str, list[Any]] = {name: [] for name in MOVES}

    async def turn(name: str) -> bool:
        """One turn of mover `name` on the grid as it is now; False when its reply could not be used."""
        mover = movers[name]
        played = len(mover.progress)
        try:
            result = await team[name].run(env.observe(name), message_history=histories[name], deps=mover)
        except (UnexpectedModelBehavior, AgentRunError):  # an empty reply (or one cut before any text)
            mover.progress.append(-1.0)
            return False
        histories[name] = result.all_messages()
        if len(mover.progress) == played:  # no tool call: the text is the move
            mover.play(str(result.output))
        return True

    for _ in range(max_turns):
        if env.done:
            break
        if not all(await asyncio.gather(*(turn(name) for name in MOVES))):
            break
    local = {name: sum(m.progress) / len(m.progress) for name, m in movers.items() if m.progress}
    return {"local": local}  # the team reward and success: the env's
