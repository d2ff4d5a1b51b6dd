"""64 episodes at once through one gateway, their clients over HTTP or in-process: every call answered,
each recorded to its own episode and agent with its own history, within a bounded time."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from mas_async.gateway.in_process import InProcessClient
from mas_async.gateway.server import Gateway
from mas_async.gateway.session import Session
from mas_async.tiny_model import build_tokenizer
from tests.unit.gateway.fakes import FakeInference, gateway_of

EPISODES = 64
TURNS = 2


@pytest.mark.parametrize("in_process", [False, True], ids=["over-http", "in-process"])
def test_64_concurrent_episodes_are_each_recorded_to_their_own_episode(in_process: bool) -> None:
    from openai import AsyncOpenAI

    tokenizer = build_tokenizer()

    async def episode(gateway: Gateway, session: Session, i: int) -> list[str]:
        """Both agents at once, each two turns that resend its history; returns the replies' episode ids."""
        client = (InProcessClient if in_process else AsyncOpenAI)(
            base_url=gateway.base_url, api_key=session.key, max_retries=0, timeout=30.0
        )
        if in_process:
            client.bind(gateway)

        async def agent(name: str) -> list[str]:
            messages, seen = [], []
            for turn in range(TURNS):
                messages.append({"role": "user", "content": f"E{i} {name[0].upper()}{turn}"})
                reply = await client.chat.completions.create(model=name, messages=messages)
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
                seen.append(reply.model_extra["mas_async"]["episode_id"])
            return seen

        try:
            return [e for seen in await asyncio.gather(agent("vertical"), agent("horizontal")) for e in seen]
        finally:
            await client.close()

    async def main() -> None:
        fake = FakeInference(tokenizer)
        fake.delay_s = 0.01  # requests of different episodes overlap in inference
        gateway = gateway_of(fake)
        await gateway.start()
        try:
            sessions = [
                gateway.open(episode_id=f"train0-{i}", problem_id=f"p{i % 8}", mode="train") for i in range(EPISODES)
            ]
            answered = await asyncio.wait_for(
                asyncio.gather(*(episode(gateway, s, i) for i, s in enumerate(sessions))), 120
            )
        finally:
            await gateway.stop()
        assert len(fake.requests) == EPISODES * 2 * TURNS
        assert max(r["n"] for r in fake.requests) == 1
        for i, (session, seen) in enumerate(zip(sessions, answered, strict=True)):
            assert seen == [session.episode_id] * 2 * TURNS
            calls = sorted(session.calls, key=lambda c: (c.agent, c.turn))
            assert [(c.agent, c.turn) for c in calls] == [
                ("horizontal", 0),
                ("horizontal", 1),
                ("vertical", 0),
                ("vertical", 1),
            ]
            for call in calls:
                # What the model saw is this episode's and this agent's own conversation, up to this turn.
                prompt = tokenizer.decode(np.asarray(call.prompt_ids).tolist())
                letter = call.agent[0].upper()
                assert prompt.count(f"E{i} {letter}") == call.turn + 1 and f"E{i} {'HV'[letter == 'H']}" not in prompt
                assert prompt.count("E") == call.turn + 1  # no other episode's message
            assert session.sources[("vertical", "reused")] == session.sources[("horizontal", "reused")] == 1
            assert session.requests == 2 * TURNS
            assert sum(session.in_process.values()) == (2 * TURNS if in_process else 0)

    asyncio.run(main())
