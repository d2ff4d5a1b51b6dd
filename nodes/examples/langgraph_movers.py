"""Plan-Path's two movers written with LangGraph and langchain-openai's `ChatOpenAI`: a graph of two agent
nodes that take turns, trained on-policy through the gateway's chat completions.

    workflow: {program: "nodes.examples.langgraph_movers:play", options: {max_turns: 6}}

Each mover is a node of a LangGraph `StateGraph` that calls its own `ChatOpenAI` (langchain-openai), pointed
at the episode's gateway (`task.base_url`, `task.api_key`; `model` names the agent) with the run's sampling
settings (`task.sampling`). The graph's state holds each mover's own conversation as LangChain messages:
every turn a mover appends the grid as a `HumanMessage`, calls its model with the whole conversation and
keeps the returned `AIMessage` as it is, so the gateway sees each call after the first resend its history
and reuses the exact token ids of the earlier turns. The graph goes vertical -> horizontal -> vertical ...
until the team reaches the goal or each mover has had `max_turns` turns.

Rewards: the env's team reward (1 on the goal); each mover's local reward is the BFS progress of its moves,
-1 for each blocked or unreadable one, averaged over its turns. `ChatOpenAI` sends its calls over HTTP (it
asks the `openai` package for raw responses, which the in-process path leaves to HTTP: docs/gateway.md).
configs/examples/langgraph_movers.yaml trains it on a built-in CPU model.
"""

from __future__ import annotations

import operator
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AnyMessage, HumanMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

MOVES = {"vertical": "UD", "horizontal": "LR"}
NEXT = {"vertical": "horizontal", "horizontal": "vertical"}


class Team(TypedDict):
    """The graph's state: each mover's conversation, and the progress of each of its moves."""

    vertical: Annotated[list[AnyMessage], operator.add]
    horizontal: Annotated[list[AnyMessage], operator.add]
    progress: Annotated[list[tuple[str, float]], operator.add]


def build(task: Any, max_turns: int) -> Any:
    """The compiled graph of one episode: a node per mover, each with its own `ChatOpenAI`."""
    env = task.env  # Plan-Path: observe(agent), step(agent, move), distance(), done, infos
    models = {
        name: ChatOpenAI(
            model=name,
            base_url=task.base_url,
            api_key=task.api_key,
            max_retries=0,  # a retried call would be a second sample
            temperature=task.sampling.temperature,
            max_tokens=task.sampling.max_tokens,
        )
        for name in MOVES
    }

    def mover(name: str) -> Any:
        async def turn(state: Team) -> dict[str, Any]:
            grid = HumanMessage(env.observe(name))
            reply = await models[name].ainvoke([*state[name], grid])
            move = str(reply.content).strip()[:1]
            if len(move) != 1 or move not in MOVES[name]:
                progress = -1.0
            else:
                before = env.distance()
                env.step(name, move)
                progress = -1.0 if env.infos[name]["blocked"] else float(before - env.distance())
            return {name: [grid, reply], "progress": [(name, progress)]}

        return turn

    def route(name: str) -> Any:
        def after(state: Team) -> str:
            turns = sum(1 for agent, _ in state["progress"] if agent == NEXT[name])
            return END if env.done or turns >= max_turns else NEXT[name]

        return after

    graph = StateGraph(Team)
    for name in MOVES:
        graph.add_node(name, mover(name))
        graph.add_conditional_edges(name, route(name), [NEXT[name], END])
    graph.add_edge(START, "vertical")
    return graph.compile()


async def play(task: Any, agents: dict[str, Any], max_turns: int = 6) -> dict[str, Any]:
    state = await build(task, max_turns).ainvoke(
        {"vertical": [], "horizontal": [], "progress": []}, {"recursion_limit": 2 * max_turns + 2}
    )
    local: dict[str, list[float]] = {}
    for name, progress in state["progress"]:
        local.setdefault(name, []).append(progress)
    return {"local": {name: sum(values) / len(values) for name, values in local.items()}}
