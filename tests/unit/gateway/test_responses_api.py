"""The Responses API (`POST /v1/responses`, mas_async/gateway/responses_api.py) through the `openai`
package: the response in the package's own model, the request read as the chat request it is (the
instructions a system message, items as messages, function tools), exact tokens across turns whether the
history comes back as items or through `previous_response_id`, `store`, a reply cut at max_output_tokens,
log-probs, every refusal, and the same outcomes in-process as over HTTP."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from openai.types.responses import Response

from mas_async.gateway.server import Gateway
from mas_async.gateway.session import Session
from mas_async.rollout.chat_prompt import chat_prompt_ids
from mas_async.tiny_model import build_tokenizer
from tests.unit.gateway.fakes import LIMITS, FakeInference, auth, openai_client, refused, serve
from tests.unit.gateway.test_in_process import _both, _outcome
from tests.unit.gateway.test_tools import CALL
from tests.unit.gateway.tokenizers import tools_tokenizer

LONGER = dataclasses.replace(LIMITS, max_calls=20)
MOVE = {
    "type": "function",
    "name": "move",
    "description": "Move the piece",
    "parameters": {"type": "object", "properties": {"dir": {"type": "string"}, "steps": {"type": "integer"}}},
    "strict": True,
}


def test_a_response_is_the_chat_call_of_its_instructions_and_input() -> None:
    async def test(gateway: Gateway, session: Session, fake: FakeInference, _h: httpx.AsyncClient) -> None:
        client = openai_client(gateway, session)
        response = await client.responses.create(model="vertical", instructions="MOVE", input="GO")
        assert isinstance(response, Response) and response.object == "response"
        Response.model_validate(response.model_dump())  # (every field in the package's shape)
        assert response.status == "completed" and response.output_text == "UD" and response.incomplete_details is None
        (message,) = response.output
        assert message.type == "message" and message.role == "assistant" and message.status == "completed"
        messages = [{"role": "system", "content": "MOVE"}, {"role": "user", "content": "GO"}]
        assert fake.requests[0]["prompt_ids"] == chat_prompt_ids(fake.tokenizer, messages).tolist()
        about = response.model_extra["mas_async"]
        assert about["prompt_source"] == "fresh" and about["turn"] == 0 and about["agent"] == "vertical"
        assert about["prompt_token_ids"] == fake.requests[0]["prompt_ids"] and about["weight_version"] == 7
        assert (
            about["token_ids"] == fake.reply_ids()
            and session.calls[0].completion.token_ids.tolist() == about["token_ids"]
        )
        assert response.usage.input_tokens == len(about["prompt_token_ids"]) and response.usage.output_tokens == 3
        await client.close()

    serve(test)


def test_a_history_sent_back_as_items_or_by_previous_response_id_reuses_the_recorded_ids() -> None:
    async def test(gateway: Gateway, session: Session, fake: FakeInference, _h: httpx.AsyncClient) -> None:
        client = openai_client(gateway, session)
        first = await client.responses.create(model="vertical", instructions="MOVE", input="GO")
        items = [{"role": "user", "content": "GO"}, *[o.model_dump() for o in first.output]]
        second = await client.responses.create(
            model="vertical", instructions="MOVE", input=[*items, {"role": "user", "content": "AGAIN"}]
        )
        third = await client.responses.create(
            model="vertical", instructions="MOVE", input="MORE", previous_response_id=second.id
        )
        sources = [r.model_extra["mas_async"]["prompt_source"] for r in (first, second, third)]
        assert sources == ["fresh", "reused", "reused"]
        # the third call's prompt is the second's, its sampled ids, then the template's rendering of the rest
        p2, p3 = fake.requests[1]["prompt_ids"], fake.requests[2]["prompt_ids"]
        assert p3[: len(p2) + 3] == [*p2, *fake.reply_ids()]
        messages = [
            {"role": "system", "content": "MOVE"},
            *[{"role": r, "content": c} for r, c in [("user", "GO"), ("assistant", "UD"), ("user", "AGAIN")]],
            *[{"role": r, "content": c} for r, c in [("assistant", "UD"), ("user", "MORE")]],
        ]
        assert fake.tokenizer.decode(p3) == fake.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        # not stored: a later call cannot continue it; an unknown id neither
        unstored = await client.responses.create(model="vertical", input="GO", store=False)
        assert unstored.store is False
        for missing in (unstored.id, "resp_unknown"):
            with pytest.raises(openai.BadRequestError) as error:
                await client.responses.create(model="vertical", input="X", previous_response_id=missing)
            assert error.value.code == "previous_response_not_found" and error.value.param == "previous_response_id"
        await client.close()

    serve(test, limits=LONGER)


def test_function_tools_and_their_calls_round_trip_with_exact_tokens() -> None:
    async def test(gateway: Gateway, session: Session, fake: FakeInference, _h: httpx.AsyncClient) -> None:
        client = openai_client(gateway, session)
        first = await client.responses.create(model="vertical", input="GO", tools=[MOVE])
        (call,) = first.output
        assert call.type == "function_call" and call.name == "move" and call.call_id.startswith("call_")
        assert call.arguments == '{"dir": "U", "steps": 2}' and first.tools[0].name == "move"
        assert "mas_async_probe" not in fake.tokenizer.decode(fake.requests[0]["prompt_ids"])
        assert '"name": "move"' in fake.tokenizer.decode(fake.requests[0]["prompt_ids"])  # the tool reached the model
        history = [
            {"role": "user", "content": "GO"},
            call.model_dump(),
            {"type": "function_call_output", "call_id": call.call_id, "output": "moved"},
        ]
        second = await client.responses.create(model="vertical", input=history, tools=[MOVE])
        assert second.model_extra["mas_async"]["prompt_source"] == "reused"
        text = fake.tokenizer.decode(fake.requests[1]["prompt_ids"])
        assert text.endswith("<tool_response>\nmoved\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
        await client.close()

    serve(test, text=CALL, tokenizer=tools_tokenizer())


def test_a_reply_cut_at_max_output_tokens_is_incomplete_and_log_probs_come_when_included() -> None:
    async def test(gateway: Gateway, session: Session, fake: FakeInference, _h: httpx.AsyncClient) -> None:
        original = fake.__call__

        async def cut(*args: Any, **kwargs: Any) -> Any:
            return [dataclasses.replace(c, finish_reason="length") for c in await original(*args, **kwargs)]

        gateway.generate = cut
        client = openai_client(gateway, session)
        response = await client.responses.create(
            model="vertical", input="GO", max_output_tokens=3, include=["message.output_text.logprobs"], top_logprobs=2
        )
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert response.output[0].status == "incomplete" and response.max_output_tokens == 3
        logprobs = response.output[0].content[0].logprobs
        assert [lp.logprob for lp in logprobs] == pytest.approx(-np.linspace(0.1, 0.5, 3))
        assert [len(lp.top_logprobs) for lp in logprobs] == [2, 2, 2]
        assert fake.requests[0]["max_tokens"] == 3 and fake.requests[0]["top_logprobs"] == 2
        await client.close()

    serve(test)


REFUSED = [
    ({"stream": True}, "stream"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"temperature": 0.5}, "temperature"),
    ({"tool_choice": "required", "tools": [MOVE]}, "tool_choice"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": None}, "input"),
    ({"mystery": 1}, "mystery"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED, ids=[p for _, p in REFUSED])
def test_what_is_not_served_is_a_400_naming_its_field(fields: dict[str, Any], param: str) -> None:
    async def test(_g: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        body = {"model": "vertical", "input": "GO", **fields}
        error = refused(await http.post("/responses", json=body, headers=auth(session)), 400)
        assert error["param"] == param, error
        assert not fake.requests and not session.calls

    serve(test, tokenizer=tools_tokenizer())


def test_labels_and_neutral_values_are_accepted() -> None:
    async def test(_g: Gateway, session: Session, _f: FakeInference, http: httpx.AsyncClient) -> None:
        body = {
            "model": "vertical",
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "GO"}]}],
            **{"metadata": {"a": "b"}, "user": "me", "store": True, "parallel_tool_calls": True, "include": []},
            **{"text": {"format": {"type": "text"}}, "truncation": "disabled", "reasoning": None, "temperature": 1},
        }
        response = await http.post("/responses", json=body, headers=auth(session))
        assert response.status_code == 200, response.text
        assert response.json()["metadata"] == {"a": "b"}

    serve(test)


async def _responses_case(client: Any, _g: Gateway, _s: Session) -> list[Any]:
    outcomes: list[Any] = []
    requests = [
        {"model": "vertical", "instructions": "MOVE", "input": "GO", "extra_headers": {"User-Agent": "Agents/x"}},
        {"model": "vertical", "input": "GO", "max_output_tokens": 2, "include": ["message.output_text.logprobs"]},
        {"model": "nobody", "input": "GO"},
        {"model": "vertical", "input": "GO", "tools": [{"type": "file_search"}]},
        {"model": "vertical", "input": "GO", "previous_response_id": "resp_x"},
    ]
    for request in requests:
        try:
            outcomes.append(await client.responses.create(**request))
        except openai.APIStatusError as e:
            outcomes.append(e)
    again = [{"role": "user", "content": "GO"}, *[o.model_dump() for o in outcomes[0].output], "MORE"]
    again[-1] = {"role": "user", "content": "MORE"}
    outcomes.append(await client.responses.create(model="vertical", instructions="MOVE", input=again))
    return outcomes


def _response_outcome(x: Any) -> Any:
    if isinstance(x, openai.APIStatusError):
        return _outcome(x)
    data = x.model_dump()
    del data["id"], data["created_at"]
    for item in data["output"]:
        del item["id"]
    return type(x), data


def test_a_responses_call_in_process_is_the_http_call() -> None:
    """In-process (the User-Agent header that the Agents SDK sends with every call stays in-process) and over
    HTTP: the same parsed requests, the same responses and errors."""
    local, remote, local_parsed, remote_parsed, _ = _both(_responses_case, limits=LONGER)
    assert [_response_outcome(x) for x in local] == [_response_outcome(x) for x in remote]
    assert local_parsed == remote_parsed and len(local_parsed) == 4
    assert local[-1].model_extra["mas_async"]["prompt_source"] == "reused"


def test_the_builtin_template_renders_tools_so_a_tool_call_reaches_the_tiny_models() -> None:
    tokenizer = build_tokenizer("tiny-ascii")
    tools = [{"type": "function", "function": {"name": "move", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "GO"}]
    with_tools = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert with_tools != plain and '"name": "move"' in with_tools
    assert plain == "<|im_start|>user\nGO<|im_end|>\n<|im_start|>assistant\n"
