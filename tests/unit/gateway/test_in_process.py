"""In-process clients (mas_async/gateway/in_process.py): a program's call answered without HTTP is the call
an HTTP client makes, request for request (what the gateway parses), reply for reply (the package's models)
and refusal for refusal (the exception's class, status, message and body); what the in-process path does not
serve goes over HTTP; and a call once made is the gateway's, as over HTTP (a cancelled or timed-out
program's call is still recorded)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest

from mas_async.gateway.in_process import InProcessClient
from mas_async.gateway.server import Gateway
from mas_async.gateway.session import Session
from tests.unit.gateway.fakes import LIMITS, FakeInference, serve
from tests.unit.gateway.test_tools import CALL, TOOLS
from tests.unit.gateway.tokenizers import tools_tokenizer

USER = {"role": "user", "content": "GO"}
Case = Callable[[Any, Gateway, Session], Awaitable[list[Any]]]


def in_process(gateway: Gateway, session: Session, **options: Any) -> InProcessClient:
    options = {"api_key": session.key, "max_retries": 0, "timeout": 10.0, **options}
    return InProcessClient(base_url=gateway.base_url, **options).bind(gateway)


async def calls(client: Any, *requests: dict[str, Any], route: str = "chat") -> list[Any]:
    """Each request's reply, or the exception it raised, in turn."""
    create = client.chat.completions.create if route == "chat" else client.completions.create
    outcomes = []
    for request in requests:
        try:
            outcomes.append(await create(**request))
        except openai.OpenAIError as e:
            outcomes.append(e)
    return outcomes


async def _plain(client: Any, _g: Gateway, _s: Session) -> list[Any]:
    return await calls(client, {"model": "vertical", "messages": [USER]})


async def _sampling(client: Any, _g: Gateway, _s: Session) -> list[Any]:
    return await calls(
        client,
        {"model": "vertical", "messages": (USER,), "n": 2, "logprobs": True, "top_logprobs": 2, "stop": ["D"]},
        {"model": "horizontal", "messages": [USER], "seed": 3, "max_tokens": 4, "temperature": 1.0, "top_p": 1},
        {"model": "vertical", "messages": (m for m in [USER]), "max_completion_tokens": 2, "user": "me"},
        {"model": "vertical", "messages": [USER], "extra_body": {"seed": 5}, "stop": None, "stream": False},
    )


async def _history(client: Any, _g: Gateway, _s: Session) -> list[Any]:
    """Turns that resend the history with the reply's own message object, then an edited one."""
    first = await client.chat.completions.create(model="vertical", messages=[USER])
    again = [USER, first.choices[0].message, {"role": "user", "content": "AGAIN"}]
    edited = [USER, {"role": "assistant", "content": "DU"}, {"role": "user", "content": "AGAIN"}]
    return [
        first,
        *await calls(client, {"model": "vertical", "messages": again}, {"model": "vertical", "messages": edited}),
    ]


async def _refusals(client: Any, _g: Gateway, _s: Session) -> list[Any]:
    return await calls(
        client,
        {"model": "diagonal", "messages": [USER]},
        {"model": "vertical", "messages": [USER], "n": 9},
        {"model": "vertical", "messages": [USER], "temperature": 0.5},
        {"model": "vertical", "messages": [USER], "top_logprobs": 2},
        {"model": "vertical", "messages": [{"role": "wizard", "content": "x"}]},
        {"model": "vertical", "messages": [USER], "frequency_penalty": 1.0},
        {"model": "vertical", "messages": [USER], "extra_body": {"mystery": 1}},
        {"model": "vertical", "messages": [USER], "tools": TOOLS, "tool_choice": "required"},
        {"model": "vertical", "messages": [{"role": "user", "content": "x" * LIMITS.max_request_bytes}]},
        {"model": "vertical", "messages": []},
    )


async def _limits_and_endings(client: Any, gateway: Gateway, session: Session) -> list[Any]:
    outcomes = await calls(client, *[{"model": "vertical", "messages": [USER]}] * (LIMITS.max_calls + 1))
    gateway.close(session)
    return [*outcomes, *await calls(client, {"model": "vertical", "messages": [USER]})]


async def _unknown_key(client: Any, _g: Gateway, _s: Session) -> list[Any]:
    return await calls(client.with_options(api_key="mas-not-a-key"), {"model": "vertical", "messages": [USER]})


async def _text(client: Any, _g: Gateway, _s: Session) -> list[Any]:
    return await calls(
        client,
        {"model": "vertical", "prompt": "GO", "n": 2, "logprobs": 2, "stop": "D"},
        {"model": "horizontal", "prompt": [5, 6, 7], "max_tokens": 3, "seed": 1},
        {"model": "vertical", "prompt": "GO", "echo": True},
        {"model": "nobody", "prompt": "GO"},
        route="text",
    )


CASES: dict[str, Case] = {
    "plain": _plain,
    "sampling fields": _sampling,
    "history": _history,
    "refusals": _refusals,
    "call limit and ended episode": _limits_and_endings,
    "unknown key": _unknown_key,
    "text completions": _text,
}


def _outcome(x: Any) -> Any:
    """What a program can read of a reply (the package's model: its type, every field but the fresh id and
    time) or of an exception (its class, status, message and body)."""
    if isinstance(x, openai.APIStatusError):
        return type(x), x.status_code, str(x), x.body, x.code, x.param, x.type
    assert isinstance(x, openai.BaseModel), x
    data = x.model_dump()
    del data["id"], data["created"]
    types = [type(x), *(type(c) for c in x.choices)]
    types += [type(c.message) for c in x.choices if hasattr(c, "message")]
    types += [type(t) for c in x.choices if hasattr(c, "message") for t in c.message.tool_calls or []]
    return types, data


def _both(case: Case, **serving: Any) -> tuple[list[Any], list[Any], list[Any], list[Any], Gateway]:
    """`case` played by an in-process client and by an HTTP client (`openai.AsyncOpenAI`), each on a fresh
    session of one gateway: their outcomes, and the requests the gateway parsed for each."""
    parsed: dict[str, list[Any]] = {}
    result: list[Any] = []

    async def test(gateway: Gateway, _session: Session, _fake: FakeInference, _http: httpx.AsyncClient) -> None:
        for name in ("chat", "text"):
            route = getattr(gateway, name)

            async def recording(session: Session, request: Any, route: Any = route) -> Any:
                parsed.setdefault(session.key, []).append(request)
                return await route(session, request)

            setattr(gateway, name, recording)
        mine = gateway.open(episode_id="train0-1", problem_id="p1", mode="train")
        theirs = gateway.open(episode_id="train0-1", problem_id="p1", mode="train")  # (the same id: same messages)
        local = in_process(gateway, mine)
        remote = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=theirs.key, max_retries=0, timeout=10.0)
        result.extend([await case(local, gateway, mine), await case(remote, gateway, theirs)])
        result.extend([parsed.get(mine.key, []), parsed.get(theirs.key, []), gateway])
        assert sum(mine.in_process.values()) == sum(1 for x in result[0] if isinstance(x, openai.BaseModel))
        assert not theirs.in_process
        await remote.close()

    serve(test, **serving)
    return tuple(result)  # type: ignore[return-value]


@pytest.mark.parametrize("name", list(CASES))
def test_an_in_process_call_is_the_http_call(name: str) -> None:
    local, remote, local_parsed, remote_parsed, _ = _both(CASES[name])
    assert [_outcome(x) for x in local] == [_outcome(x) for x in remote]
    assert local_parsed == remote_parsed
    assert local  # (every case makes calls)


def test_tool_calls_in_process_are_the_http_ones() -> None:
    async def case(client: Any, _g: Gateway, _s: Session) -> list[Any]:
        first = await client.chat.completions.create(model="vertical", messages=[USER], tools=TOOLS)
        call = first.choices[0].message.tool_calls[0]
        history = [USER, first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "ok"}]
        return [first, *await calls(client, {"model": "vertical", "messages": history, "tools": TOOLS})]

    local, remote, local_parsed, remote_parsed, _ = _both(case, text=CALL, tokenizer=tools_tokenizer())
    # (a tool call's id is fresh in each reply, and the history sends it back)
    for outcome in (*local, *remote):
        for choice in outcome.choices:
            for call in choice.message.tool_calls or []:
                call.id = "call_x"
    for request in (*local_parsed, *remote_parsed):
        for message in request.messages:
            message.update({"tool_call_id": "call_x"} if "tool_call_id" in message else {})
            for call in message.get("tool_calls") or []:
                call["id"] = "call_x"
    assert [_outcome(x) for x in local] == [_outcome(x) for x in remote]
    assert local_parsed == remote_parsed
    assert local[0].choices[0].finish_reason == "tool_calls"
    assert local[1].model_extra["mas_async"]["prompt_source"] == "reused"


def test_what_the_in_process_path_does_not_serve_goes_over_http() -> None:
    async def test(gateway: Gateway, session: Session, fake: FakeInference, _http: httpx.AsyncClient) -> None:
        client = in_process(gateway, session)
        chat = client.chat.completions
        stream = await chat.create(model="vertical", messages=[USER], stream=True)
        assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == "UD"
        await chat.create(model="vertical", messages=[USER], extra_headers={"Authorization": f"Bearer {session.key}"})
        raw = await chat.with_raw_response.create(model="vertical", messages=[USER])
        assert raw.parse().choices[0].message.content == "UD"
        elsewhere = gateway.base_url.replace("127.0.0.1", "localhost")  # (the same gateway, another base URL)
        await client.with_options(base_url=elsewhere).chat.completions.create(model="vertical", messages=[USER])
        assert session.turns["vertical"] == 4 and not session.in_process  # every one of them over HTTP
        # A copy with other options still calls in-process, as does the client's own `with_options`.
        await client.with_options(timeout=5.0).chat.completions.create(model="vertical", messages=[USER])
        assert session.in_process["vertical"] == 1
        # Extra headers that the gateway does not read (the Agents SDK's User-Agent) stay in-process.
        await chat.create(model="vertical", messages=[USER], extra_headers={"User-Agent": "Agents/Python"})
        assert session.in_process["vertical"] == 2
        # A call made on another event loop (a thread's) goes over HTTP to the gateway's loop.
        other = InProcessClient(base_url=gateway.base_url, api_key=session.key, max_retries=0).bind(gateway)
        await asyncio.to_thread(asyncio.run, other.completions.create(model="vertical", prompt="GO"))
        assert session.turns["vertical"] == 7 and session.in_process["vertical"] == 2
        # A per-call timeout, even 0 (which equals False), is the package's to apply, over HTTP.
        with pytest.raises(openai.APITimeoutError):
            await chat.create(model="vertical", messages=[USER], timeout=0)
        await asyncio.sleep(0.1)
        assert session.in_process["vertical"] == 2

    serve(test, limits=LIMITS.__class__(**{**LIMITS.__dict__, "max_calls": 10}))


def test_a_call_once_made_is_recorded_when_the_program_is_cancelled_or_times_out() -> None:
    async def test(gateway: Gateway, session: Session, fake: FakeInference, _http: httpx.AsyncClient) -> None:
        fake.delay_s = 0.3
        client = in_process(gateway, session)
        call = asyncio.ensure_future(client.chat.completions.create(model="vertical", messages=[USER]))
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        with pytest.raises(openai.APITimeoutError):
            await client.with_options(timeout=0.05).chat.completions.create(model="horizontal", messages=[USER])
        assert session.calls == []  # both still in inference
        await asyncio.sleep(0.6)
        assert sorted(c.agent for c in session.calls) == ["horizontal", "vertical"]
        assert session.in_process == {"vertical": 1, "horizontal": 1}

    serve(test)


def test_on_an_external_gateway_an_in_process_call_needs_the_run_token_as_over_http() -> None:
    """The in-process path is no way around the run's token: a key without it is refused (401, counted)
    exactly as the HTTP route refuses it, and the program's own key (token.episode) is answered."""
    from mas_async.gateway.access import Access

    async def test(gateway: Gateway, _s: Session, _f: FakeInference, _http: httpx.AsyncClient) -> None:
        gateway.access = Access("run-token")
        mine, theirs = (gateway.open(episode_id="train0-1", problem_id="p1", mode="train") for _ in range(2))
        outcomes = []
        for key_of in (gateway.api_key, lambda s: s.key, lambda s: f"wrong-token.{s.key}"):
            local = in_process(gateway, mine, api_key=key_of(mine))
            remote = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=key_of(theirs), max_retries=0)
            outcomes.append([_outcome(x) for x in await _plain(local, gateway, mine)])
            outcomes.append([_outcome(x) for x in await _plain(remote, gateway, theirs)])
            await remote.close()
        answered, answered_over_http, *refusals = outcomes
        assert answered == answered_over_http and answered[0][1]["choices"][0]["message"]["content"] == "UD"
        assert refusals[0] == refusals[1] and refusals[2] == refusals[3]
        assert all(r[0][:2] == (openai.AuthenticationError, 401) for r in refusals)
        assert gateway.access.refused == 4 and mine.in_process["vertical"] == 1 and not theirs.in_process

    serve(test)
