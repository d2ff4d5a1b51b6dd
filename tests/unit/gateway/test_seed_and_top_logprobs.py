"""`seed` and `top_logprobs` at the gateway (requests.py, completions.py, sampling.py, responses.py): each
reaches inference as asked (and nothing extra on an ordinary request), every bad value is a 400 naming its
field, and the alternatives come back in OpenAI's shapes, chat's and the legacy API's, streamed or not,
cut at a stop string with their tokens."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import numpy as np
import pytest

from mas_async.gateway import responses
from mas_async.gateway.server import Gateway
from mas_async.gateway.session import Session
from mas_async.tiny_model import build_tokenizer
from mas_async.wire.messages import MAX_SEED
from mas_async.wire.samples import Completion
from tests.unit.gateway.fakes import LIMITS, FakeInference, alternatives, auth, chat, openai_client, refused, serve

MESSAGES = [{"role": "user", "content": "GO"}]


def _expected_top(fake: FakeInference, k: int) -> list[list[tuple[str, float]]]:
    """What the fake's k alternatives of each position read as: (token, log-prob), most likely first."""
    ids = np.asarray(fake.reply_ids(), dtype=np.int32)
    top_ids, top_lps = alternatives(ids, -np.linspace(0.1, 0.5, len(ids)).astype(np.float32), k)
    return [
        [(fake.tokenizer.decode([i]), round(v, 4)) for i, v in zip(row, lps, strict=True)]
        for row, lps in zip(top_ids.tolist(), top_lps.tolist(), strict=True)
    ]


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"seed": -1}, "seed", "at least 0"),
        ({"seed": MAX_SEED + 1}, "seed", f"at most {MAX_SEED}"),
        ({"seed": "7"}, "seed", "integer"),
        ({"seed": 7.0}, "seed", "integer"),
        ({"seed": True}, "seed", "integer"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "at most 20"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "at least 0"),
        ({"logprobs": True, "top_logprobs": 2.5}, "top_logprobs", "integer"),
        ({"top_logprobs": 2}, "top_logprobs", "only allowed when logprobs is true"),
        ({"logprobs": False, "top_logprobs": 3}, "top_logprobs", "only allowed when logprobs is true"),
    ],
)
def test_a_bad_seed_or_top_logprobs_is_a_400_naming_the_field(fields: dict, param: str, words: str) -> None:
    async def test(_g: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        error = refused(await http.post("/chat/completions", json=chat(**fields), headers=auth(session)), 400)
        assert error["param"] == param and words in error["message"], error
        assert fake.requests == [] and session.requests == 0

    serve(test)


def test_seed_and_top_logprobs_reach_inference_as_asked_and_nothing_extra_otherwise() -> None:
    async def test(_g: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        h = auth(session)
        bodies = [
            chat(),
            chat(logprobs=True),
            chat(top_logprobs=0),  # the neutral value a client library may send
            chat(seed=0, logprobs=True, top_logprobs=0),
            chat(seed=MAX_SEED, logprobs=True, top_logprobs=20),
            {"model": "vertical", "prompt": "GO", "logprobs": 5, "seed": 9},
            {"model": "vertical", "prompt": "GO", "logprobs": 0},
        ]
        for body in bodies:
            route = "/completions" if "prompt" in body else "/chat/completions"
            (await http.post(route, json=body, headers=h)).raise_for_status()
        asked = [(r["seed"], r["top_logprobs"]) for r in fake.requests]
        assert asked == [(None, 0), (None, 0), (None, 0), (0, 0), (MAX_SEED, 20), (9, 5), (None, 0)]
        assert all(c.completion.top_ids is None for c in session.calls[:4])

    serve(test, limits=dataclasses.replace(LIMITS, max_calls=10))


def test_chat_top_logprobs_in_openais_shape_streamed_or_not() -> None:
    async def test(gateway: Gateway, session: Session, fake: FakeInference, _http: httpx.AsyncClient) -> None:
        client = openai_client(gateway, session)
        reply = await client.chat.completions.create(
            model="vertical", messages=MESSAGES, n=2, logprobs=True, top_logprobs=3, seed=42
        )
        stream = await client.chat.completions.create(
            model="vertical", messages=MESSAGES, logprobs=True, top_logprobs=3, seed=42, stream=True
        )
        chunks = [chunk async for chunk in stream]
        plain = await client.chat.completions.create(model="vertical", messages=MESSAGES, logprobs=True)
        await client.close()
        assert [(r["seed"], r["top_logprobs"], r["n"]) for r in fake.requests] == [(42, 3, 2), (42, 3, 1), (None, 0, 1)]
        expected = _expected_top(fake, 3)
        for choice in reply.choices:
            entries = choice.logprobs.content
            assert [t.token for t in entries] == ["U", "D", "<|im_end|>"]
            tops = [[(a.token, round(a.logprob, 4)) for a in t.top_logprobs] for t in entries]
            assert tops == expected
            assert all(a.bytes == list(a.token.encode()) for t in entries for a in t.top_logprobs)
            assert all(t.top_logprobs[0].logprob == t.logprob for t in entries)  # the fake's sampled id ranks first
        streamed = [t for c in chunks for t in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
        assert [t.model_dump() for t in streamed] == [t.model_dump() for t in reply.choices[0].logprobs.content]
        assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content)

    serve(test)


def test_legacy_logprobs_k_maps_the_alternatives_and_the_sampled_token_streamed_or_not() -> None:
    async def test(gateway: Gateway, session: Session, fake: FakeInference, _http: httpx.AsyncClient) -> None:
        client = openai_client(gateway, session)
        reply = await client.completions.create(model="vertical", prompt="GO", logprobs=2, seed=3)
        stream = await client.completions.create(model="vertical", prompt="GO", logprobs=2, seed=3, stream=True)
        chunks = [chunk async for chunk in stream]
        await client.close()
        assert [(r["seed"], r["top_logprobs"]) for r in fake.requests] == [(3, 2), (3, 2)]
        legacy = reply.choices[0].logprobs
        expected = [dict(row) for row in _expected_top(fake, 2)]
        assert [{t: round(v, 4) for t, v in d.items()} for d in legacy.top_logprobs] == expected
        assert legacy.tokens == ["U", "D", "<|im_end|>"]
        streamed = [d for c in chunks if c.choices[0].logprobs for d in c.choices[0].logprobs.top_logprobs]
        assert streamed == legacy.top_logprobs

    serve(test)


def test_the_legacy_top_logprobs_also_hold_the_sampled_token_when_it_is_not_among_the_k() -> None:
    tokenizer = build_tokenizer()
    ids = np.asarray(tokenizer.encode("UD", add_special_tokens=False), dtype=np.int32)
    lps = np.array([-3.0, -0.5], dtype=np.float32)
    top_ids = np.array([[ids[1], ids[1] + 1], [ids[1], ids[1] + 1]], dtype=np.int32)
    top_lps = np.array([[-0.1, -0.2], [-0.5, -1.5]], dtype=np.float32)
    completion = Completion(ids, lps, 1, "length", top_ids, top_lps)
    choice = responses.text_choice(tokenizer, 0, "UD", completion, np.array([5], np.int32), True)
    u, d, e = "U", "D", tokenizer.decode([int(ids[1]) + 1])
    assert choice["logprobs"]["top_logprobs"] == [
        {d: pytest.approx(-0.1), e: pytest.approx(-0.2), u: -3.0},  # k + 1 entries: the sampled U is not in the top 2
        {d: -0.5, e: -1.5},
    ]
    chat_choice = responses.chat_choice(tokenizer, 0, "UD", completion, np.array([5], np.int32), True, False)
    assert [[a["token"] for a in t["top_logprobs"]] for t in chat_choice["logprobs"]["content"]] == [[d, e], [d, e]]


def test_a_stop_string_cuts_the_alternatives_with_the_tokens() -> None:
    async def test(_g: Gateway, session: Session, _f: FakeInference, http: httpx.AsyncClient) -> None:
        body: dict[str, Any] = chat(stop=" R", logprobs=True, top_logprobs=2)
        choice = (await http.post("/chat/completions", json=body, headers=auth(session))).json()["choices"][0]
        assert choice["message"]["content"] == "UD L" and choice["finish_reason"] == "stop"
        assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
        assert all(len(t["top_logprobs"]) == 2 for t in choice["logprobs"]["content"])
        completion = session.calls[0].completion
        assert completion.top_ids.shape == completion.top_logprobs.shape == (len(choice["token_ids"]), 2)

    serve(test, text="UD L RRR")
