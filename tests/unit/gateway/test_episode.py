"""A workflow program's episode (mas_async/gateway/episode.py): the shipped example runs through a real
gateway with fake inference, and every call becomes a sample of its agent's turn with the program's rewards."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from mas_async.gateway.episode import GatewayEpisode, RewardError, read_rewards
from mas_async.gateway.workflow import ProgramError, load_program
from mas_async.tiny_model import build_tokenizer
from tests.unit.gateway.fakes import LIMITS, POLICY_OF, FakeInference, plan_path_env, play_program


def play(program: Any, mode: str = "train", **options: Any) -> tuple[GatewayEpisode, FakeInference]:
    """Play one episode of `program` through a started gateway whose inference always answers U."""
    fake = FakeInference(build_tokenizer(), text="U")
    episode = play_program(program, fake, limits=dataclasses.replace(LIMITS, max_calls=64), mode=mode, options=options)
    return episode, fake


def test_the_example_program_records_each_call_as_its_agents_turn() -> None:
    program = load_program("nodes.examples.openai_movers:play")
    episode, fake = play(program, max_turns=3)
    samples = episode.samples
    # The fake always answers "U": the vertical mover moves (or bumps), the horizontal one never parses.
    assert [(s.agent, s.turn) for s in samples] == [
        (agent, turn) for turn in range(3) for agent in ("vertical", "horizontal")
    ][: len(samples)]
    assert len(samples) == len(fake.requests) >= 2
    for sample, request in zip(samples, fake.requests, strict=True):
        assert sample.group == f"p9/{sample.agent}/{sample.turn}"
        assert sample.policy == POLICY_OF[sample.agent] == request["policy"]
        assert sample.prompt_ids.tolist() == request["prompt_ids"]
        assert sample.version == 7 and len(sample.logprobs) == len(sample.completion_ids)
        assert sample.info["prompt_source"] == ("fresh" if sample.turn == 0 else "reused")
    horizontal = [s for s in samples if s.agent == "horizontal"]
    assert horizontal and all(s.reward == 2.0 * episode.env.team_reward() - 1.0 for s in horizontal)
    summary = episode.finish()
    assert summary["gateway/calls/horizontal"] == len(horizontal)
    assert summary["gateway/reused/horizontal"] == len(horizontal) - 1
    assert summary["gateway/prefix_mismatch/vertical"] == 0 and summary["gateway/prefix_mismatch/horizontal"] == 0
    assert summary["reward/horizontal"] == -1.0 + 2.0 * episode.env.team_reward()
    assert summary["tokens"] == sum(len(s.completion_ids) for s in samples)
    assert {s.episode_return for s in samples} == {
        2.0 * episode.env.team_reward() + sum(episode.rewards.local.values())
    }


async def _edits(task: Any, agents: dict[str, Any]) -> dict[str, Any]:
    chat = [{"role": "user", "content": "GO"}]
    first = await agents["vertical"].chat.completions.create(model="vertical", messages=chat)
    chat.append({"role": "assistant", "content": first.choices[0].message.content + " "})  # edited history
    chat.append({"role": "user", "content": "AGAIN"})
    await agents["vertical"].chat.completions.create(model="vertical", messages=chat)
    return {"team": 0.5, "local": {"vertical": 1.0}, "success": True}


def test_an_edited_history_is_counted_and_the_returned_rewards_are_credited() -> None:
    episode, fake = play(_edits)
    summary = episode.finish()
    assert summary["gateway/prefix_mismatch/vertical"] == 1 and summary["gateway/reused/vertical"] == 0
    assert summary["success"] is True and summary["reward/vertical"] == 2.0 and summary["reward/horizontal"] == 1.0
    assert [s.reward for s in episode.samples] == [2.0, 2.0]
    assert episode.samples[1].prompt_ids.tolist() == fake.requests[1]["prompt_ids"]


def test_evaluation_records_no_samples() -> None:
    episode, fake = play(_edits, mode="eval")
    assert episode.samples == [] and len(fake.requests) == 2
    assert episode.finish()["gateway/calls/vertical"] == 2


async def _fails(task: Any, agents: dict[str, Any]) -> None:
    await agents["vertical"].chat.completions.create(model="vertical", messages=[{"role": "user", "content": "GO"}])
    raise KeyError("a bug in the program")


def test_a_failing_program_fails_its_episode_and_closes_its_session() -> None:
    with pytest.raises(KeyError, match="a bug"):
        play(_fails)


def test_the_programs_clients_share_the_gateways_pool_over_aiohttp() -> None:
    from openai import AsyncOpenAI, DefaultAioHttpClient

    seen: list[Any] = []

    async def program(task: Any, agents: dict[str, Any]) -> None:
        seen.extend(agents.values())
        reply = await agents["horizontal"].chat.completions.create(
            model="horizontal", messages=[{"role": "user", "content": "GO"}]
        )
        seen.append(reply)

    episode, fake = play(program)
    *clients, reply = seen
    assert all(isinstance(client, AsyncOpenAI) and client.max_retries == 0 for client in clients)
    # One pool for all of them (the gateway's), on aiohttp's transport: the cheaper one per call.
    assert len({id(client._client) for client in clients}) == 1
    assert isinstance(clients[0]._client, DefaultAioHttpClient)
    assert reply.choices[0].message.content == "U" and len(episode.samples) == len(fake.requests) == 1


def test_rewards_are_read_or_refused_with_a_sentence() -> None:
    env = plan_path_env()
    agents = ("vertical", "horizontal")
    assert read_rewards(None, env, agents).team == env.team_reward()
    assert read_rewards(0.25, env, agents).team == 0.25
    assert read_rewards({"local": {"vertical": 1}}, env, agents).local == {"vertical": 1.0}
    for bad, match in [
        ("x", "returns None, a team reward or a dict"),
        ({"teams": 1}, "unknown key"),
        ({"local": {"diagonal": 1}}, "agents of the run"),
        ({"team": float("nan")}, "finite"),
        (True, "returns None, a team reward or a dict"),
    ]:
        with pytest.raises(RewardError, match=match):
            read_rewards(bad, env, agents)


def test_a_program_path_that_names_no_async_function_is_refused() -> None:
    with pytest.raises(ProgramError, match="module:function"):
        load_program("nodes.examples.openai_movers")
    with pytest.raises(ProgramError, match="no attribute"):
        load_program("nodes.examples.openai_movers:nothing")
    with pytest.raises(ProgramError, match="not an async function"):
        load_program("nodes.examples.openai_movers:MOVES")
