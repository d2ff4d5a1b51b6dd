"""The gateway's rough edges, each pinned: a refused call gives its turn back; deeply nested JSON is a 400,
not a 500 with a traceback; a header aiohttp cannot parse gets an OpenAI error that quotes nothing (the
run's token stays out of the reply and the log); a huge request is tokenised off the event loop, so other
episodes' calls go on meanwhile; an env whose `observe` raises still closes its episode's session; text
parts of a message are joined by a newline, as vLLM joins them."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import httpx
import pytest

from mas_async.gateway.errors import GatewayError
from mas_async.gateway.in_process import InProcessClient
from mas_async.gateway.server import Gateway
from mas_async.gateway.session import Session
from tests.unit.gateway import fakes
from tests.unit.gateway.fakes import LIMITS, FakeInference, auth, chat, play_program, refused, serve

TOO_LONG = "Generate.prompt_ids: 600 tokens + max_tokens 8 exceed the model's 512 positions"


def test_a_call_the_inference_server_refuses_gives_its_turn_back() -> None:
    async def test(_g: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        fake.fail = TOO_LONG
        refused(await http.post("/chat/completions", json=chat(), headers=auth(session)), 400)
        fake.fail = None
        response = await http.post("/chat/completions", json=chat(), headers=auth(session))
        assert response.json()["mas_async"]["turn"] == 0  # the retry is turn 0 again
        assert [c.turn for c in session.calls] == [0] and session.turns["vertical"] == 1
        assert session.sources[("vertical", "fresh")] == 1

    serve(test)


def test_deeply_nested_json_is_a_400() -> None:
    async def test(gateway: Gateway, session: Session, _f: FakeInference, http: httpx.AsyncClient) -> None:
        body = '{"model": "vertical", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
        for route in ("/chat/completions", "/completions", "/responses"):
            response = await http.post(
                route, content=body, headers={**auth(session), "Content-Type": "application/json"}
            )
            assert "JSON" in refused(response, 400)["message"]
        with pytest.raises(GatewayError) as refusal:  # (in-process: the error the HTTP route answers with)
            await gateway.answer("chat", f"Bearer {session.key}", body)
        assert refusal.value.status == 400

    serve(test, limits=dataclasses.replace(LIMITS, max_request_bytes=1024 * 1024))


def test_a_header_over_aiohttps_limit_gets_an_openai_error_without_its_start(caplog: Any) -> None:
    secret = "run-token-SECRET"
    replies: list[bytes] = []

    async def test(gateway: Gateway, _s: Session, _f: FakeInference, _http: httpx.AsyncClient) -> None:
        host, port = httpx.URL(gateway.base_url).host, httpx.URL(gateway.base_url).port
        reader, writer = await asyncio.open_connection(host, port)
        value = f"Bearer {secret}.{'k' * 9000}"
        request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: {value}\r\nContent-Length: 2\r\n\r\n{{}}"
        )
        writer.write(request.encode())
        await writer.drain()
        replies.append(await asyncio.wait_for(reader.read(), 10))
        writer.close()

    with caplog.at_level(logging.DEBUG):
        serve(test)
    head, _, body = replies[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b" 400 " in head.split(b"\r\n")[0]
    assert b"application/json" in head
    error = httpx.Response(400, content=body).json()["error"]
    assert error["code"] == "malformed_request" and set(error) == {"message", "type", "param", "code"}
    assert secret.encode() not in replies[0]
    assert secret not in caplog.text and "kkkk" not in caplog.text


def test_a_huge_request_is_tokenised_off_the_event_loop(monkeypatch) -> None:
    """While a huge request's prompt is tokenised, a small call of another episode is answered. The huge
    prompt's rendering is held until the small call has its answer: rendered on the event loop, it would hold
    the loop too, the small call could not be answered, and the huge one would finish first."""
    import threading

    from mas_async.gateway.transcript import Transcript

    small_answered = threading.Event()
    render = Transcript.prompt

    def held(self, messages, tools=None):
        if sum(len(str(m.get("content", ""))) for m in messages) > 100_000:
            small_answered.wait(timeout=20)
        return render(self, messages, tools)

    monkeypatch.setattr(Transcript, "prompt", held)

    async def test(gateway: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        other = gateway.open(episode_id="train0-2", problem_id="p2", mode="train")
        client = InProcessClient(base_url=gateway.base_url, api_key=other.key, max_retries=0, timeout=60.0)
        client.bind(gateway)
        huge = asyncio.ensure_future(
            http.post("/chat/completions", json=chat("UD" * 150_000), headers=auth(session), timeout=120.0)
        )
        while not any(t.name.startswith("gateway-prompts") for t in threading.enumerate()) and not huge.done():
            await asyncio.sleep(0.01)  # (until the huge request's rendering has begun)
        await client.chat.completions.create(model="vertical", messages=[{"role": "user", "content": "GO"}])
        small_answered.set()
        assert not huge.done(), "the small call was answered after the huge one"
        assert (await huge).status_code == 200
        assert [len(r["prompt_ids"]) < 1000 for r in fake.requests] == [True, False]

    serve(test, limits=dataclasses.replace(LIMITS, max_request_bytes=1024 * 1024))


class _BrokenObserve:
    """An env whose `observe` raises (a bug in the env)."""

    def observe(self, agent: str) -> str:
        raise RuntimeError("observe is broken")


def test_an_env_whose_observe_raises_closes_its_episodes_session(monkeypatch: Any) -> None:
    """`play_program` checks, whatever happens, that the episode's session was closed (its key then gets
    "episode ended"); the env's error is the episode's."""

    async def never_called(task: Any, agents: dict[str, Any]) -> None:
        raise AssertionError("the program is not reached")

    monkeypatch.setattr(fakes, "plan_path_env", _BrokenObserve)
    with pytest.raises(RuntimeError, match="observe is broken"):
        play_program(never_called, FakeInference(None), limits=LIMITS)


def test_text_parts_of_a_message_are_joined_by_a_newline() -> None:
    async def test(_g: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        parts = [{"type": "text", "text": "GO"}, {"type": "text", "text": "NOW"}]
        body = {"model": "vertical", "messages": [{"role": "user", "content": parts}]}
        assert (await http.post("/chat/completions", json=body, headers=auth(session))).status_code == 200
        plain = {"model": "vertical", "messages": [{"role": "user", "content": "GO\nNOW"}]}
        assert (await http.post("/chat/completions", json=plain, headers=auth(session))).status_code == 200
        assert fake.requests[0]["prompt_ids"] == fake.requests[1]["prompt_ids"]

    serve(test)
