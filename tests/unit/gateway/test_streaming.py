"""Streaming (`stream: true`, mas_async/gateway/streaming.py): OpenAI's chunks read by the `openai` client,
the same choices and the same recorded samples as a call without streaming, the extra fields on each
choice's last chunk, and the usual error JSON for a call refused before its stream starts."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from mas_async.gateway.server import Gateway
from mas_async.gateway.session import Session
from mas_async.gateway.streaming import pieces
from mas_async.tiny_model import build_tokenizer
from tests.unit.gateway.fakes import FakeInference, auth, chat, openai_client, serve
from tests.unit.gateway.tokenizers import merging_tokenizer

MESSAGES = [{"role": "user", "content": "GO"}]


def test_a_streamed_chat_completion_is_the_same_call_as_an_unstreamed_one() -> None:
    async def test(gateway: Gateway, session: Session, fake: FakeInference, _http: httpx.AsyncClient) -> None:
        client = openai_client(gateway, session)
        plain = await client.chat.completions.create(model="vertical", messages=MESSAGES, n=2, logprobs=True)
        stream = await client.chat.completions.create(
            model="vertical", messages=MESSAGES, n=2, logprobs=True, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        await client.close()
        assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
        *choice_chunks, usage = chunks
        assert usage.choices == [] and usage.usage.model_dump() == plain.usage.model_dump()
        assert all(c.usage is None for c in choice_chunks)
        for index, expected in enumerate(plain.choices):
            mine = [c.choices[0] for c in choice_chunks if c.choices[0].index == index]
            first, *middle, last = mine
            assert first.delta.role == "assistant"
            assert "".join(c.delta.content or "" for c in mine) == expected.message.content == "UD"
            streamed_logprobs = [t for c in middle for t in c.logprobs.content]
            assert [(t.token, t.logprob) for t in streamed_logprobs] == [
                (t.token, t.logprob) for t in expected.logprobs.content
            ]
            assert all(c.finish_reason is None for c in mine[:-1]) and last.finish_reason == "stop"
            assert last.token_ids == expected.token_ids
            assert last.prompt_token_ids == expected.prompt_token_ids
            assert last.weight_version == expected.weight_version == 7
        assert chunks[-2].model_extra["mas_async"]["turn"] == 1  # the second call of the agent
        # Both calls were recorded alike: same prompt, same sampled ids, log-probs and version.
        assert [c.turn for c in session.calls] == [0, 0, 1, 1]
        for unstreamed, streamed in zip(session.calls[:2], session.calls[2:], strict=True):
            assert streamed.prompt_ids.tolist() == unstreamed.prompt_ids.tolist()
            assert streamed.completion.token_ids.tolist() == unstreamed.completion.token_ids.tolist()
            assert streamed.completion.logprobs.tolist() == unstreamed.completion.logprobs.tolist()
            assert streamed.completion.version == unstreamed.completion.version

    serve(test)


def test_the_events_are_sse_lines_ending_with_done() -> None:
    async def test(_g: Gateway, session: Session, _f: FakeInference, http: httpx.AsyncClient) -> None:
        response = await http.post("/chat/completions", json=chat(stream=True, stop=["L R"]), headers=auth(session))
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = response.text.split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        assert all(e.startswith("data: {") for e in events[:-2])
        assert '"usage"' not in response.text  # asked for no usage
        chunks = [json.loads(e[len("data: ") :]) for e in events[:-2]]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "UD "  # cut before "L R"
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert build_tokenizer().decode(chunks[-1]["choices"][0]["token_ids"]) == "UD L R"
        # With include_usage, every chunk says "usage": null and one last chunk has the usage and no choices.
        asked = chat(stream=True, stream_options={"include_usage": True})
        response = await http.post("/chat/completions", json=asked, headers=auth(session))
        *chunks, usage = [json.loads(e[len("data: ") :]) for e in response.text.split("\n\n")[:-2]]
        assert all("usage" in c and c["usage"] is None for c in chunks)
        assert (
            usage["choices"] == []
            and usage["usage"]["completion_tokens"] == len(build_tokenizer().encode("UD L RRR")) + 1
        )

    serve(test, text="UD L RRR")


def test_a_stream_refused_before_it_starts_is_the_usual_error() -> None:
    async def test(gateway: Gateway, session: Session, fake: FakeInference, _http: httpx.AsyncClient) -> None:
        client = openai_client(gateway, session)
        with pytest.raises(openai.BadRequestError, match="above this run's K"):
            await client.chat.completions.create(model="vertical", messages=MESSAGES, n=9, stream=True)
        with pytest.raises(openai.NotFoundError, match="diagonal"):
            await client.chat.completions.create(model="diagonal", messages=MESSAGES, stream=True)
        fake.fail = "generate request 1 to policy 'pv' timed out after 1s"
        with pytest.raises(openai.InternalServerError, match="timed out"):
            await client.chat.completions.create(model="vertical", messages=MESSAGES, stream=True)
        gateway.close(session)
        with pytest.raises(openai.ConflictError, match="has ended"):
            await client.chat.completions.create(model="vertical", messages=MESSAGES, stream=True)
        await client.close()
        assert session.calls == []

    serve(test)


def test_pieces_split_the_text_token_by_token_and_always_join_to_it() -> None:
    tokenizer = merging_tokenizer()
    ids = [*tokenizer.convert_tokens_to_ids(["U", "D", "UD", " ", "L"]), tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert pieces(tokenizer, ids, "UDUD L") == ["U", "D", "UD", " ", "L", ""]
    assert pieces(tokenizer, ids, "UDU") == ["U", "D", "U", "", "", ""]  # a text cut inside a token
    assert pieces(tokenizer, ids, "UDUD LX") == ["U", "D", "UD", " ", "L", "X"]  # text the ids do not hold
    assert pieces(tokenizer, [], "") == []
