"""The legacy text completions route (`POST /v1/completions`, mas_async/gateway/completions.py): a prompt
as text (no chat template) or token ids, OpenAI's `text_completion` with exact tokens and legacy
log-probs, streaming, the calls recorded as the agent's turns, and each refused field."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from mas_async.gateway.server import Gateway
from mas_async.gateway.session import Session
from mas_async.tiny_model import build_tokenizer
from tests.unit.gateway.fakes import FakeInference, auth, openai_client, refused, serve
from tests.unit.gateway.tokenizers import merging_tokenizer


def text(prompt: Any = "GO", **fields: Any) -> dict[str, Any]:
    return {"model": "vertical", "prompt": prompt, **fields}


def test_a_text_prompt_is_tokenised_without_a_template_and_recorded_as_a_fresh_turn() -> None:
    async def test(gateway: Gateway, session: Session, fake: FakeInference, _http: httpx.AsyncClient) -> None:
        client = openai_client(gateway, session)
        reply = await client.completions.create(model="horizontal", prompt="GO L", n=2, logprobs=0, max_tokens=4)
        await client.close()
        tokenizer = build_tokenizer()
        prompt = tokenizer.encode("GO L")
        assert fake.requests == [
            {"policy": "ph", "prompt_ids": prompt, "n": 2, "greedy": False, "max_tokens": 4, "temperature": 1.0,
             "seed": None, "top_logprobs": 0}
        ]  # fmt: skip
        assert reply.object == "text_completion" and reply.model == "horizontal"
        choice = reply.choices[0]
        assert [c.text for c in reply.choices] == ["UD", "UD"] and choice.finish_reason == "stop"
        assert choice.token_ids == fake.reply_ids() and choice.prompt_token_ids == prompt
        assert choice.weight_version == 7
        assert choice.logprobs.tokens == ["U", "D", "<|im_end|>"]
        assert [round(x, 3) for x in choice.logprobs.token_logprobs] == [-0.1, -0.3, -0.5]
        assert choice.logprobs.text_offset == [0, 1, 2]
        assert [list(d) for d in choice.logprobs.top_logprobs] == [["U"], ["D"], ["<|im_end|>"]]
        assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == 6
        assert reply.model_extra["mas_async"]["prompt_source"] == "fresh"
        assert [(c.agent, c.turn, c.index, c.prompt_source) for c in session.calls] == [
            ("horizontal", 0, 0, "fresh"),
            ("horizontal", 0, 1, "fresh"),
        ]
        assert session.calls[0].prompt_ids.tolist() == prompt
        assert session.sources[("horizontal", "fresh")] == 1

    serve(test)


def test_a_prompt_of_token_ids_is_sent_as_it_is_and_stop_cuts_the_text() -> None:
    async def test(_g: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        h = auth(session)
        body = (await http.post("/completions", json=text([5, 45, 28], stop="L R"), headers=h)).json()
        assert fake.requests[0]["prompt_ids"] == [5, 45, 28]
        assert body["choices"][0]["text"] == "UD " and body["choices"][0]["finish_reason"] == "stop"
        assert build_tokenizer().decode(body["choices"][0]["token_ids"]) == "UD L R"
        (await http.post("/completions", json=text([[5, 45]]), headers=h)).raise_for_status()  # a list of one prompt
        assert fake.requests[1]["prompt_ids"] == [5, 45]

    serve(test, text="UD L RRR")


def test_legacy_logprobs_offsets_follow_the_tokens_text() -> None:
    async def test(_g: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        choice = (await http.post("/completions", json=text(logprobs=0), headers=auth(session))).json()["choices"][0]
        assert fake.reply_ids() == [*fake.tokenizer.convert_tokens_to_ids(["UD", " ", "L"]), fake.reply_ids()[-1]]
        assert choice["logprobs"]["tokens"] == ["UD", " ", "L", "<|im_end|>"]
        assert choice["logprobs"]["text_offset"] == [0, 2, 3, 4]

    serve(test, text="UD L", tokenizer=merging_tokenizer())


def test_a_streamed_text_completion_matches_the_unstreamed_one() -> None:
    async def test(gateway: Gateway, session: Session, fake: FakeInference, _http: httpx.AsyncClient) -> None:
        client = openai_client(gateway, session)
        plain = await client.completions.create(model="vertical", prompt="GO", logprobs=0)
        stream = await client.completions.create(
            model="vertical", prompt="GO", logprobs=0, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        await client.close()
        *choice_chunks, usage = chunks
        assert usage.choices == [] and usage.usage.total_tokens == plain.usage.total_tokens
        assert "".join(c.choices[0].text for c in choice_chunks) == plain.choices[0].text == "UD"
        tokens = [t for c in choice_chunks[:-1] for t in c.choices[0].logprobs.tokens]
        assert tokens == plain.choices[0].logprobs.tokens
        last = choice_chunks[-1].choices[0]
        assert last.finish_reason == "stop" and last.token_ids == plain.choices[0].token_ids
        assert last.prompt_token_ids == plain.choices[0].prompt_token_ids and last.weight_version == 7
        assert [c.turn for c in session.calls] == [0, 1]

    serve(test)


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"prompt": ["GO", "UP"]}, "prompt", "2 prompts"),
        ({"prompt": [[5], [6]]}, "prompt", "2 prompts"),
        ({"prompt": ""}, "prompt", "non-empty"),
        ({"prompt": [5, 9999]}, "prompt", "outside the vocabulary"),
        ({"prompt": None}, "prompt", "required"),
        ({"logprobs": 6}, "logprobs", "at most 5"),
        ({"logprobs": -1}, "logprobs", "at least 0"),
        ({"top_logprobs": 2}, "top_logprobs", "chat field"),
        ({"seed": -1}, "seed", "at least 0"),
        ({"seed": 2**63}, "seed", "at most 9223372036854775807"),
        ({"seed": 1.5}, "seed", "integer"),
        ({"logprobs": True}, "logprobs", "integer"),
        ({"echo": True}, "echo", "not served"),
        ({"suffix": "X"}, "suffix", "not served"),
        ({"best_of": 3}, "best_of", "use n"),
        ({"n": 5}, "n", "K"),
        ({"temperature": 0.5}, "temperature", "off-policy"),
        ({"max_completion_tokens": 4}, "max_completion_tokens", "Unrecognized"),
        ({"messages": []}, "messages", "Unrecognized"),
    ],
)
def test_each_refused_field_is_named_and_nothing_reaches_inference(fields: dict, param: str, words: str) -> None:
    async def test(_g: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        error = refused(await http.post("/completions", json=text(**fields), headers=auth(session)), 400)
        assert error["param"] == param and words in error["message"], error
        assert fake.requests == [] and session.requests == 0

    serve(test)


def test_the_openai_client_raises_its_exceptions_for_text_completions() -> None:
    async def test(gateway: Gateway, session: Session, _f: FakeInference, _http: httpx.AsyncClient) -> None:
        client = openai_client(gateway, session)
        with pytest.raises(openai.NotFoundError, match="diagonal"):
            await client.completions.create(model="diagonal", prompt="GO")
        with pytest.raises(openai.BadRequestError, match="echo"):
            await client.completions.create(model="vertical", prompt="GO", echo=True, stream=True)
        gateway.close(session)
        with pytest.raises(openai.ConflictError, match="has ended"):
            await client.completions.create(model="vertical", prompt="GO")
        await client.close()

    serve(test)


def test_malformed_json_and_a_prompt_over_the_context_are_refused_and_the_route_keeps_serving() -> None:
    async def test(_g: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        h = auth(session)
        assert (
            "not valid JSON"
            in refused(await http.post("/completions", content=b'{"prompt": ', headers=h), 400)["message"]
        )
        fake.fail = "Generate.prompt_ids: 600 tokens + max_tokens 8 exceed the model's 512 positions"
        error = refused(await http.post("/completions", json=text("GO" * 300), headers=h), 400)
        assert "512 positions" in error["message"]
        fake.fail = None
        assert (await http.post("/completions", json=text(), headers=h)).json()["choices"][0]["text"] == "UD"
        assert [c.turn for c in session.calls] == [0]  # the refused call recorded nothing and gave turn 0 back

    serve(test)
