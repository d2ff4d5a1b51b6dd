"""Plan-Path's two movers written against the OpenAI API: a workflow program, not a Workflow class.

A workflow program is a plain async function; the run calls it once per episode with the episode's task
and one `openai.AsyncOpenAI` client per agent, and trains on every call it makes (docs/gateway.md):

    workflow: {program: "nodes.examples.openai_movers:play", options: {max_turns: 6}}

This one uses nothing but the `openai` package. Each mover keeps its own conversation: every turn it
sends the grid as it is now as a new user message after the earlier exchanges (so the gateway reuses
the token ids of those exchanges instead of tokenising them again) and answers with one move, "U" or "D"
for the vertical mover, "L" or "R" for the horizontal one. The team reward is the env's (1 on the goal);
each mover's local reward is the BFS progress of its moves, -1 for each blocked or unreadable one,
averaged over its turns. configs/examples/openai_movers.yaml trains it on the tiny CPU model.

`score` is its scorer for tree sampling (`workflow.scorer`, configs/examples/openai_movers_tree.yaml):
each training call is then K candidate moves of the same grid, the scorer plays each on a clone of the
env, and the program gets the best one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from openai import AsyncOpenAI

MOVES = {"vertical": "UD", "horizontal": "LR"}


async def play(task: Any, agents: dict[str, AsyncOpenAI], max_turns: int = 6) -> dict[str, Any]:
    env = task.env  # Plan-Path: observe(agent), step(agent, move), distance(), done, infos
    chats: dict[str, list[dict[str, Any]]] = {agent: [] for agent in MOVES}
    progress = {agent: [] for agent in MOVES}
    for _ in range(max_turns):
        for agent, moves in MOVES.items():
            if env.done:
                break
            chat = chats[agent]
            chat.append({"role": "user", "content": env.observe(agent)})
            reply = await agents[agent].chat.completions.create(model=agent, messages=chat)
            text = reply.choices[0].message.content or ""
            chat.append({"role": "assistant", "content": text})
            move = text.strip()[:1]
            if len(move) != 1 or move not in moves:
                progress[agent].append(-1.0)
                continue
            before = env.distance()
            env.step(agent, move)
            progress[agent].append(-1.0 if env.infos[agent]["blocked"] else float(before - env.distance()))
    local = {agent: sum(values) / len(values) for agent, values in progress.items() if values}
    return {"local": local}  # the team reward and success: the env's


async def score(task: Any, agent: str, messages: list[dict[str, Any]], choice: dict[str, Any]) -> float:
    """A candidate's score under tree sampling (`workflow.scorer`): its move played on a clone of the env as
    the program left it (before the move), scored as the node classes score a mover's candidate (with
    alpha 1): the team reward after it plus the progress it made, -1 for a blocked or unreadable move."""
    env = task.env
    move = (choice["content"] or "").strip()[:1]
    if len(move) != 1 or move not in MOVES[agent]:
        return -1.0
    clone = env.clone()
    clone.step(agent, move)
    progress = -1.0 if clone.infos[agent]["blocked"] else float(env.distance() - clone.distance())
    return clone.team_reward() + progress
