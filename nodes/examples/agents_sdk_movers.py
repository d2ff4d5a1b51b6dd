"""Plan-Path's two movers written with the OpenAI Agents SDK: two `Agent` objects with a function tool,
trained on-policy through the gateway's Responses API (the SDK's default model).

    workflow: {program: "nodes.examples.agents_sdk_movers:play", options: {max_turns: 6}}

Each mover is an `agents.Agent` whose model is the SDK's `OpenAIResponsesModel` on the client the run gives
that agent (its `model` names the agent), with one tool, `move(direction)`, that plays a move on the
episode's env. Every round both movers see the grid as it is and take their turn concurrently: a turn is
one `Runner.run` that either calls `move` (the SDK runs the tool and stops there: `stop_on_first_tool`) or
answers with the move as text, which the program then plays. Each mover keeps its own conversation, the
SDK's items of its earlier turns (`result.to_input_list()`) followed by the new grid, so every call after
a mover's first resends its history and the gateway reuses the exact token ids of its earlier turns.

The sampling settings are the run's, read from the task (`task.sampling`), so the SDK asks exactly what
the run trains on. A reply cut at `max_tokens` is the Responses API's `status: "incomplete"`, which the
SDK raises as a `ModelBehaviorError`: that mover's move is lost (-1) and the team stops after the round.
Rewards: the env's team reward (1 on the goal); each mover's local reward is the BFS progress of its moves,
-1 for each blocked, unreadable or lost one, averaged over its turns. configs/examples/agents_sdk_movers.yaml
trains it on a built-in CPU model; docs/gateway.md shows it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agents import (
    Agent,
    ModelBehaviorError,
    ModelSettings,
    OpenAIResponsesModel,
    RunConfig,
    RunContextWrapper,
    Runner,
    function_tool,
)

if TYPE_CHECKING:
    from openai import AsyncOpenAI

MOVES = {"vertical": "UD", "horizontal": "LR"}
INSTRUCTIONS = {
    "vertical": "You move the token A up or down to reach G with your teammate. Call move with U or D.",
    "horizontal": "You move the token A left or right to reach G with your teammate. Call move with L or R.",
}


@dataclass
class Mover:
    """One mover's side of the episode: the env it plays on and the progress of each of its moves."""

    env: Any
    agent: str
    progress: list[float] = field(default_factory=list)

    def play(self, text: str) -> str:
        """Play the move that `text` starts with, if it is one of this mover's; what the grid is now."""
        move = text.strip()[:1]
        if self.env.done or len(move) != 1 or move not in MOVES[self.agent]:
            self.progress.append(-1.0)
            return f"not a move: answer {' or '.join(MOVES[self.agent])}"
        before = self.env.distance()
        self.env.step(self.agent, move)
        self.progress.append(-1.0 if self.env.infos[self.agent]["blocked"] else float(before - self.env.distance()))
        return self.env.observe(self.agent)


@function_tool
def move(ctx: RunContextWrapper[Mover], direction: str) -> str:
    """Move the token one cell.

    Args:
        direction: U or D for the vertical mover, L or R for the horizontal one.
    """
    return ctx.context.play(direction)


async def play(task: Any, agents: dict[str, AsyncOpenAI], max_turns: int = 6) -> dict[str, Any]:
    env = task.env  # Plan-Path: observe(agent), step(agent, move), distance(), done, infos
    settings = ModelSettings(temperature=task.sampling.temperature, max_tokens=task.sampling.max_tokens)
    team = {
        name: Agent(
            name=name,
            instructions=INSTRUCTIONS[name],
            model=OpenAIResponsesModel(model=name, openai_client=agents[name]),
            model_settings=settings,
            tools=[move],
            tool_use_behavior="stop_on_first_tool",
        )
        for name in MOVES
    }
    movers = {name: Mover(env, name) for name in MOVES}
    histories: dict[str, list[Any]] = {name: [] for name in MOVES}
    config = RunConfig(tracing_disabled=True)  # (the run records every call itself; nothing leaves the machine)

    async def turn(name: str) -> bool:
        """One turn of mover `name` on the grid as it is now; False when its reply was cut."""
        items = [*histories[name], {"role": "user", "content": env.observe(name)}]
        try:
            result = await Runner.run(team[name], items, context=movers[name], max_turns=2, run_config=config)
        except ModelBehaviorError:  # a reply cut at max_tokens (status "incomplete"): the move is lost
            movers[name].progress.append(-1.0)
            return False
        histories[name] = result.to_input_list()
        called = any(getattr(item, "type", "") == "tool_call_item" for item in result.new_items)
        if not called:  # answered with text: the program plays it
            movers[name].play(str(result.final_output or ""))
        return True

    for _ in range(max_turns):
        if env.done:
            break
        if not all(await asyncio.gather(*(turn(name) for name in MOVES))):
            break
    local = {name: sum(m.progress) / len(m.progress) for name, m in movers.items() if m.progress}
    return {"local": local}  # the team reward and success: the env's
