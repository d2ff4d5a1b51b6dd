"""Tools through the gateway (mas_async/gateway/tools.py): tools rendered by a chat template that supports
them, a scripted engine's Hermes tool call parsed into `message.tool_calls`, the returned call and a tool
result sent back reusing the sampled ids, and the refusals (a template without tools, a forced choice)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from mas_async.gateway.server import Gateway
from mas_async.gateway.session import Session
from mas_async.gateway.tools import parse_reply
from tests.unit.gateway.fakes import FakeInference, auth, openai_client, refused, serve
from tests.unit.gateway.tokenizers import plain_tokenizer, tools_tokenizer

CALL = '<tool_call>\n{"name": "move", "arguments": {"dir": "U", "steps": 2}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "move",
            "description": "Move the piece",
            "parameters": {"type": "object", "properties": {"dir": {"type": "string"}, "steps": {"type": "integer"}}},
        },
    }
]
USER = {"role": "user", "content": "Go up twice."}


def test_a_hermes_reply_becomes_tool_calls_and_sending_them_back_reuses_the_sampled_ids() -> None:
    async def test(gateway: Gateway, session: Session, fake: FakeInference, _http: httpx.AsyncClient) -> None:
        client = openai_client(gateway, session)
        reply = await client.chat.completions.create(model="vertical", messages=[USER], tools=TOOLS)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "move"
        assert json.loads(call.function.arguments) == {"dir": "U", "steps": 2}
        assert choice.token_ids == fake.reply_ids()  # the sampled ids, tags and all
        # The tools reached the model through the template.
        tokenizer = fake.tokenizer
        assert '"name": "move"' in tokenizer.decode(fake.requests[0]["prompt_ids"]).split("<|im_start|>user")[0]
        # The program sends back the assistant message it got, and the tool's result.
        history = [
            USER,
            choice.message,  # the message object itself, as the OpenAI cookbook appends it
            {"role": "tool", "tool_call_id": call.id, "content": "ok"},
        ]
        second = await client.chat.completions.create(model="vertical", messages=history, tools=TOOLS)
        await client.close()
        assert second.model_extra["mas_async"]["prompt_source"] == "reused"
        sent = fake.requests[1]["prompt_ids"]
        head = [*choice.prompt_token_ids, *choice.token_ids]
        assert sent[: len(head)] == head
        rendered = tokenizer.decode(sent)
        assert rendered.endswith("<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
        assert session.sources[("vertical", "reused")] == 1
        assert [c.completion.token_ids.tolist() for c in session.calls] == [
            choice.token_ids,
            second.choices[0].token_ids,
        ]

    serve(test, text=CALL, tokenizer=tools_tokenizer())


def test_an_edited_tool_call_or_other_tools_are_a_prefix_mismatch() -> None:
    async def test(_g: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        h = auth(session)
        body = {"model": "vertical", "messages": [USER], "tools": TOOLS}
        message = (await http.post("/chat/completions", json=body, headers=h)).json()["choices"][0]["message"]
        result = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "ok"}
        # The same call with its arguments re-serialised and a new id still is the reply given: reused.
        same = json.loads(json.dumps(message))
        same["tool_calls"][0]["id"] = "call_renamed"
        same["tool_calls"][0]["function"]["arguments"] = json.dumps({"dir": "U", "steps": 2}, indent=1)
        # The same call with its arguments in another order is the agent's own, but the template writes
        # them in that order, not as sampled: retokenized.
        reordered = json.loads(json.dumps(message))
        reordered["tool_calls"][0]["function"]["arguments"] = json.dumps({"steps": 2, "dir": "U"})
        edited = json.loads(json.dumps(message))
        edited["tool_calls"][0]["function"]["arguments"] = json.dumps({"dir": "D", "steps": 2})
        sources = []
        for reply, tools in (
            (same, TOOLS),
            (reordered, TOOLS),
            (edited, TOOLS),
            (message, [*TOOLS, {**TOOLS[0], "function": {"name": "x"}}]),
        ):
            again = {"model": "vertical", "messages": [USER, reply, result], "tools": tools}
            sources.append(
                (await http.post("/chat/completions", json=again, headers=h)).json()["mas_async"]["prompt_source"]
            )
        assert sources == ["reused", "retokenized", "edited", "edited"]
        assert session.sources[("vertical", "edited")] == 2

    serve(test, text=CALL, tokenizer=tools_tokenizer())


def test_tool_choice_none_renders_the_tools_and_returns_the_text_unparsed() -> None:
    async def test(_g: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        body = {"model": "vertical", "messages": [USER], "tools": TOOLS, "tool_choice": "none"}
        choice = (await http.post("/chat/completions", json=body, headers=auth(session))).json()["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": CALL}
        assert choice["finish_reason"] == "stop"
        assert "Tools:" in fake.tokenizer.decode(fake.requests[0]["prompt_ids"])

    serve(test, text=CALL, tokenizer=tools_tokenizer())


def test_tools_with_a_template_that_ignores_them_are_refused_before_inference() -> None:
    async def test(_g: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        body = {"model": "vertical", "messages": [{"role": "user", "content": "GO"}], "tools": TOOLS}
        error = refused(await http.post("/chat/completions", json=body, headers=auth(session)), 400)
        assert error["param"] == "tools" and "does not render tools" in error["message"]
        named = {**body, "tool_choice": {"type": "function", "function": {"name": "move"}}}
        assert (
            refused(await http.post("/chat/completions", json=named, headers=auth(session)), 400)["param"]
            == "tool_choice"
        )
        assert fake.requests == [] and session.requests == 0

    serve(test, tokenizer=plain_tokenizer())  # a template without tools (SmolLM2's is one)


def test_a_streamed_tool_call_arrives_whole_with_the_extra_fields() -> None:
    async def test(gateway: Gateway, session: Session, fake: FakeInference, _http: httpx.AsyncClient) -> None:
        client = openai_client(gateway, session)
        stream = await client.chat.completions.create(model="vertical", messages=[USER], tools=TOOLS, stream=True)
        chunks = [chunk async for chunk in stream]
        await client.close()
        deltas = [c.choices[0].delta for c in chunks]
        assert deltas[0].role == "assistant"
        [calls] = [d.tool_calls for d in deltas if d.tool_calls]
        assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            (0, "move", {"dir": "U", "steps": 2})
        ]
        assert calls[0].id.startswith("call_") and calls[0].type == "function"
        last = chunks[-1].choices[0]
        assert last.finish_reason == "tool_calls" and last.token_ids == fake.reply_ids()

    serve(test, text=CALL, tokenizer=tools_tokenizer())


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("plain", "plain", []),
        (f"Let me move.\n{CALL}", "Let me move.", [("move", {"dir": "U", "steps": 2})]),
        (
            f"{CALL}\n{CALL.replace('move', 'look')}",
            None,
            [("move", {"dir": "U", "steps": 2}), ("look", {"dir": "U", "steps": 2})],
        ),
        ('<tool_call>\n{"name": "stop"}', None, [("stop", {})]),  # unterminated, no arguments
        ('<tool_call>\n{"name": "move", "arguments": {"dir"\n</tool_call>', None, None),  # not JSON: all text
        ('<tool_call>\n["move"]\n</tool_call>', None, None),  # JSON without a name
    ],
)
def test_hermes_parsing_reads_what_vllms_parser_reads(text: str, content: str | None, calls: Any) -> None:
    parsed_content, parsed = parse_reply(text)
    if calls is None:  # not a tool call: the whole reply is the content
        assert (parsed_content, parsed) == (text, [])
        return
    assert parsed_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == calls
    assert len({c["id"] for c in parsed}) == len(parsed)
