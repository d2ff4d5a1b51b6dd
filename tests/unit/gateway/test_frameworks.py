"""Teams written with agent frameworks, each played through a live gateway with fake inference: the OpenAI
Agents SDK movers (nodes/examples/agents_sdk_movers.py, the Responses API) with their clients in-process and
over HTTP, a model that calls their `move` tool (the SDK runs it, and the call and its output come back as
items that reuse the recorded ids), and the LangGraph + ChatOpenAI movers (chat completions). Every call
after an agent's first is reused, none edited. Skipped without the frameworks (the `frameworks` extra)."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import pytest

from mas_async.gateway.episode import GatewayEpisode
from mas_async.gateway.loading import load_program
from mas_async.tiny_model import build_tokenizer
from tests.unit.gateway import fakes
from tests.unit.gateway.fakes import LIMITS, FakeInference, play_program

LIMITS_64 = dataclasses.replace(LIMITS, max_calls=64)
MOVE_UP = '<tool_call>\n{"name": "move", "arguments": {"direction": "U"}}\n</tool_call>'


def _needs(*packages: str) -> pytest.MarkDecorator:
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (the frameworks extra)")


def _play(path: str, text: str, in_process: bool, monkeypatch: Any) -> tuple[GatewayEpisode, FakeInference]:
    fake = FakeInference(build_tokenizer("tiny-ascii"), text=text)
    gateway_of = fakes.gateway_of

    def configured(fake: FakeInference, limits: Any) -> Any:
        gateway = gateway_of(fake, limits)
        gateway.in_process = in_process
        return gateway

    monkeypatch.setattr(fakes, "gateway_of", configured)
    episode = play_program(load_program(path), fake, limits=LIMITS_64, options={"max_turns": 3})
    return episode, fake


def _every_later_call_reused(episode: GatewayEpisode, in_process: bool) -> dict[str, Any]:
    summary = episode.finish()
    for agent in ("vertical", "horizontal"):
        calls = summary[f"gateway/calls/{agent}"]
        assert calls >= 2, summary
        assert summary[f"gateway/reused/{agent}"] == calls - 1 and summary[f"gateway/prefix_mismatch/{agent}"] == 0
        assert summary[f"gateway/fresh/{agent}"] == 1  # its first call only: no later history was lost
        assert summary[f"gateway/in_process/{agent}"] == (calls if in_process else 0)
    assert [s.info["prompt_source"] for s in episode.samples if s.turn == 0] == ["fresh", "fresh"]
    return summary


@_needs("agents")
@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "over-http"])
def test_the_agents_sdk_team_plays_through_the_responses_api(in_process: bool, monkeypatch: Any) -> None:
    episode, fake = _play("nodes.examples.agents_sdk_movers:play", "U", in_process, monkeypatch)
    _every_later_call_reused(episode, in_process)
    first = fake.tokenizer.decode(fake.requests[0]["prompt_ids"])
    assert first.startswith("<|im_start|>system\nYou move the token A") and '"name": "move"' in first  # the tool
    assert {r["max_tokens"] for r in fake.requests} == {LIMITS.max_tokens}  # the run's settings, from the task


@_needs("agents")
def test_the_agents_sdk_runs_the_tool_the_model_calls_and_its_items_reuse_the_ids(monkeypatch: Any) -> None:
    episode, fake = _play("nodes.examples.agents_sdk_movers:play", MOVE_UP, True, monkeypatch)
    _every_later_call_reused(episode, True)
    later = fake.tokenizer.decode(fake.requests[-1]["prompt_ids"])
    assert MOVE_UP in later and "<tool_response>" in later  # the call and its output, sent back as items
    assert episode.rewards.local["horizontal"] == -1.0  # "U" is not a horizontal move
    assert episode.rewards.local["vertical"] != -1.0 or episode.env.infos["vertical"]["blocked"]


@_needs("langgraph", "langchain_openai")
def test_the_langgraph_team_plays_through_chat_completions(monkeypatch: Any) -> None:
    episode, _ = _play("nodes.examples.langgraph_movers:play", "U", False, monkeypatch)
    summary = _every_later_call_reused(episode, False)
    assert summary["gateway/calls/vertical"] == 3 and summary["gateway/calls/horizontal"] == 3


class Alternating(FakeInference):
    """Answers a tool call (`MOVE_UP`), then plain text, then a tool call again, ..."""

    calls = 0

    def reply_ids(self) -> list[int]:
        self.calls += 1
        self.text = MOVE_UP if self.calls % 2 else "U"
        return super().reply_ids()


@_needs("pydantic_ai")
@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "over-http"])
def test_the_pydantic_ai_team_plays_through_the_responses_api(in_process: bool, monkeypatch: Any) -> None:
    episode, _ = _play("nodes.examples.pydantic_ai_movers:play", "U", in_process, monkeypatch)
    _every_later_call_reused(episode, in_process)


@_needs("pydantic_ai")
def test_pydantic_ai_runs_the_tool_the_model_calls_and_sends_it_back_with_exact_tokens(monkeypatch: Any) -> None:
    """The model calls `move`, pydantic-ai runs it and calls the model again with the call and its result
    (function_call and function_call_output items), which reuses the recorded ids."""
    fake = Alternating(build_tokenizer("tiny-ascii"))
    episode = play_program(
        load_program("nodes.examples.pydantic_ai_movers:play"), fake, limits=LIMITS_64, options={"max_turns": 2}
    )
    _every_later_call_reused(episode, True)
    prompts = [fake.tokenizer.decode(r["prompt_ids"]) for r in fake.requests]
    assert any(MOVE_UP in p and "<tool_response>" in p for p in prompts)
