"""The gateway's HTTP server (mas_async/gateway/server.py) on a real socket, with a fake `generate` that
records every request: OpenAI's response shape with exact tokens, the sampling rules, and an OpenAI-shaped
error (never a crash or a hang) for every request it refuses."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import numpy as np
import pytest

from mas_async.gateway.server import Gateway, Limits
from mas_async.gateway.session import Session
from mas_async.tiny_model import IM_END_ID, build_tokenizer
from mas_async.wire.samples import Completion

LIMITS = Limits(max_n=4, max_tokens=8, temperature=1.0, eval_greedy=True, max_calls=5, max_request_bytes=64 * 1024)
POLICY_OF = {"vertical": "pv", "horizontal": "ph"}


class InferenceDown(RuntimeError):
    pass


class FakeInference:
    """Answers every request with the reply `text` (+ <|im_end|>) at weight version 7, and records it."""

    def __init__(self, tokenizer: Any, text: str = "UD") -> None:
        self.tokenizer = tokenizer
        self.text = text
        self.requests: list[dict[str, Any]] = []
        self.fail: str | None = None
        self.during: Callable[[], None] | None = None
        """Called while a request is being served (e.g. to end the episode meanwhile)."""

    async def __call__(self, policy, prompt_ids, n, greedy, *, max_tokens, temperature) -> list[Completion]:
        self.requests.append(
            {"policy": policy, "prompt_ids": prompt_ids.tolist(), "n": n, "greedy": greedy,
             "max_tokens": max_tokens, "temperature": temperature}
        )  # fmt: skip
        if self.fail:
            raise InferenceDown(self.fail)
        if self.during is not None:
            self.during()
        ids = [*self.tokenizer.encode(self.text, add_special_tokens=False), IM_END_ID]
        logprobs = -np.linspace(0.1, 0.5, len(ids)).astype(np.float32)
        return [Completion(np.asarray(ids, dtype=np.int32), logprobs, 7, "stop") for _ in range(n)]


def serve(
    test: Callable[[Gateway, Session, FakeInference, httpx.AsyncClient], Awaitable[None]],
    *,
    mode: str = "train",
    text: str = "UD",
) -> None:
    """Run `test` against a started gateway with one open session, then stop the gateway."""
    tokenizer = build_tokenizer()

    async def main() -> None:
        fake = FakeInference(tokenizer, text)
        gateway = Gateway(
            policy_of=POLICY_OF,
            tokenizers={"pv": tokenizer, "ph": tokenizer},
            generate=fake,
            limits=LIMITS,
            generate_errors=(InferenceDown,),
        )
        await gateway.start()
        session = gateway.open(episode_id="train0-1", problem_id="p1", mode=mode)
        try:
            async with httpx.AsyncClient(base_url=gateway.base_url, timeout=10.0) as http:
                await asyncio.wait_for(test(gateway, session, fake, http), 30)
        finally:
            await gateway.stop()

    asyncio.run(main())


def auth(session: Session) -> dict[str, str]:
    return {"Authorization": f"Bearer {session.key}"}


def chat(content: str = "GO", **fields: Any) -> dict[str, Any]:
    return {"model": "vertical", "messages": [{"role": "user", "content": content}], **fields}


def test_the_openai_client_gets_a_completion_with_its_exact_tokens_and_version() -> None:
    from openai import AsyncOpenAI

    async def test(gateway: Gateway, session: Session, fake: FakeInference, _http: httpx.AsyncClient) -> None:
        client = AsyncOpenAI(base_url=gateway.base_url, api_key=session.key, max_retries=0)
        reply = await client.chat.completions.create(
            model="vertical", messages=[{"role": "user", "content": "GO"}], n=2, logprobs=True, max_tokens=4
        )
        await client.close()
        assert [c.message.content for c in reply.choices] == ["UD", "UD"]
        assert [c.finish_reason for c in reply.choices] == ["stop", "stop"]
        [request] = fake.requests
        assert request == {"policy": "pv", "prompt_ids": request["prompt_ids"], "n": 2, "greedy": False,
                           "max_tokens": 4, "temperature": 1.0}  # fmt: skip
        choice = reply.choices[0]
        sampled = [*build_tokenizer().encode("UD", add_special_tokens=False), IM_END_ID]
        assert choice.token_ids == sampled
        assert choice.prompt_token_ids == request["prompt_ids"]
        assert choice.weight_version == 7
        assert [t.token for t in choice.logprobs.content] == ["U", "D", "<|im_end|>"]
        assert [round(t.logprob, 3) for t in choice.logprobs.content] == [-0.1, -0.3, -0.5]
        assert reply.usage.prompt_tokens == len(request["prompt_ids"]) and reply.usage.completion_tokens == 6
        # Both choices are this agent's turn 0 of the episode, recorded with what the model saw and sampled.
        assert [(c.agent, c.turn, c.index) for c in session.calls] == [("vertical", 0, 0), ("vertical", 0, 1)]
        assert session.calls[0].prompt_ids.tolist() == request["prompt_ids"]

    serve(test)


def test_models_lists_the_agents() -> None:
    async def test(_g: Gateway, session: Session, _f: FakeInference, http: httpx.AsyncClient) -> None:
        response = await http.get("/models", headers=auth(session))
        assert response.status_code == 200
        assert [(m["id"], m["owned_by"]) for m in response.json()["data"]] == [("vertical", "pv"), ("horizontal", "ph")]

    serve(test)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_every_refusal_is_an_openai_error_and_the_gateway_keeps_serving() -> None:
    async def test(gateway: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        post = http.post
        h = auth(session)
        error = _error(await post("/chat/completions", content=b"{not json", headers=h), 400)
        assert "not valid JSON" in error["message"]
        error = _error(await post("/chat/completions", json=chat(model="diagonal"), headers=h), 404)
        assert error["code"] == "model_not_found" and "vertical" in error["message"]
        assert _error(await post("/chat/completions", json=chat()), 401)["code"] == "invalid_api_key"
        bad_key = {"Authorization": "Bearer mas-nothing"}
        assert _error(await post("/chat/completions", json=chat(), headers=bad_key), 401)["code"] == "invalid_api_key"
        assert _error(await post("/chat/completions", json=chat(n=5), headers=h), 400)["param"] == "n"
        assert _error(await post("/chat/completions", json=chat(max_tokens=9), headers=h), 400)["param"] == "max_tokens"
        error = _error(await post("/chat/completions", json=chat(temperature=0.5), headers=h), 400)
        assert error["param"] == "temperature" and "off-policy" in error["message"]
        assert _error(await post("/chat/completions", json=chat(top_p=0.9), headers=h), 400)["param"] == "top_p"
        assert _error(await post("/chat/completions", json=chat(stream=True), headers=h), 400)["param"] == "stream"
        assert _error(await post("/chat/completions", json=chat(tools=[{}]), headers=h), 400)["param"] == "tools"
        assert _error(await post("/chat/completions", json=chat(bogus=1), headers=h), 400)["param"] == "bogus"
        assert (
            _error(await post("/chat/completions", json={"model": "vertical"}, headers=h), 400)["param"] == "messages"
        )
        _error(await post("/chat/completions", json=[1, 2], headers=h), 400)
        _error(await post("/chat/completions", content=b"x" * (65 * 1024), headers=h), 413)
        _error(await http.get("/nowhere", headers=h), 404)
        _error(await http.get("/chat/completions", headers=h), 405)
        assert fake.requests == [] and session.calls == [] and session.requests == 0  # nothing reached inference
        fake.fail = "generate request 5 to policy 'pv' timed out after 1s"
        error = _error(await post("/chat/completions", json=chat(), headers=h), 500)
        assert error["type"] == "server_error" and "timed out" in error["message"]
        fake.fail = "Generate.prompt_ids: 600 tokens + max_tokens 8 exceed the model's 512 positions"
        assert "512 positions" in _error(await post("/chat/completions", json=chat(), headers=h), 400)["message"]
        fake.fail = None
        for _ in range(session.max_calls - session.requests):
            assert (await post("/chat/completions", json=chat(), headers=h)).status_code == 200
        assert _error(await post("/chat/completions", json=chat(), headers=h), 400)["code"] == "episode_call_limit"
        gateway.close(session)
        assert _error(await post("/chat/completions", json=chat(), headers=h), 409)["code"] == "episode_ended"
        assert _error(await http.get("/models", headers=h), 409)["code"] == "episode_ended"

    serve(test)


def test_the_openai_client_raises_its_own_exceptions_for_refusals() -> None:
    import openai

    async def test(gateway: Gateway, session: Session, _f: FakeInference, _http: httpx.AsyncClient) -> None:
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=session.key, max_retries=0)
        messages = [{"role": "user", "content": "GO"}]
        with pytest.raises(openai.NotFoundError, match="diagonal"):
            await client.chat.completions.create(model="diagonal", messages=messages)
        with pytest.raises(openai.BadRequestError, match="above this run's K"):
            await client.chat.completions.create(model="vertical", messages=messages, n=9)
        gateway.close(session)
        with pytest.raises(openai.ConflictError, match="has ended"):
            await client.chat.completions.create(model="vertical", messages=messages)
        await client.close()

    serve(test)


def test_a_repeated_history_reuses_the_recorded_ids_and_an_edited_one_is_counted() -> None:
    async def test(_g: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        h = auth(session)
        first = (await http.post("/chat/completions", json=chat(), headers=h)).json()
        assert first["mas_async"] == {
            "episode_id": "train0-1",
            "agent": "vertical",
            "turn": 0,
            "prompt_source": "fresh",
        }
        reply = first["choices"][0]
        history = [{"role": "user", "content": "GO"}, {"role": "assistant", "content": reply["message"]["content"]}]
        again = {"model": "vertical", "messages": [*history, {"role": "user", "content": "AGAIN"}]}
        second = (await http.post("/chat/completions", json=again, headers=h)).json()
        assert second["mas_async"]["turn"] == 1 and second["mas_async"]["prompt_source"] == "reused"
        sent = fake.requests[1]["prompt_ids"]
        assert sent[: len(reply["prompt_token_ids"]) + len(reply["token_ids"])] == [
            *reply["prompt_token_ids"],
            *reply["token_ids"],
        ]
        assert second["choices"][0]["prompt_token_ids"] == sent
        edited = json.loads(json.dumps(again))
        edited["messages"][1]["content"] = "D"
        third = (await http.post("/chat/completions", json=edited, headers=h)).json()
        assert third["mas_async"]["prompt_source"] == "edited"
        # The sample holds what the model saw: the fresh rendering of the edited history.
        assert session.calls[-1].prompt_ids.tolist() == fake.requests[2]["prompt_ids"]
        assert session.sources[("vertical", "edited")] == 1 and session.sources[("vertical", "reused")] == 1

    serve(test)


def test_stop_strings_cut_the_choice_at_the_token_that_completes_them() -> None:
    async def test(_g: Gateway, session: Session, _f: FakeInference, http: httpx.AsyncClient) -> None:
        body = (await http.post("/chat/completions", json=chat(stop=["L R"]), headers=auth(session))).json()
        choice = body["choices"][0]
        assert choice["message"]["content"] == "UD "
        assert choice["finish_reason"] == "stop"
        assert build_tokenizer().decode(choice["token_ids"]) == "UD L R"
        assert session.calls[0].completion.token_ids.tolist() == choice["token_ids"]
        assert len(session.calls[0].completion.logprobs) == len(choice["token_ids"])

    serve(test, text="UD L RRR")


def test_evaluation_decodes_greedily_unless_the_request_asks_for_a_temperature() -> None:
    async def test(_g: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        h = auth(session)
        for fields in ({}, {"temperature": 0.5}, {"temperature": 0}):
            assert (await http.post("/chat/completions", json=chat(**fields), headers=h)).status_code == 200
        assert [(r["greedy"], r["temperature"]) for r in fake.requests] == [(True, 1.0), (False, 0.5), (True, 1.0)]
        assert _error(await http.post("/chat/completions", json=chat(temperature=1.5), headers=h), 400)

    serve(test, mode="eval")


def test_a_call_in_flight_when_its_episode_ends_is_refused_and_not_recorded() -> None:
    async def test(gateway: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        fake.during = lambda: gateway.close(session)
        error = _error(await http.post("/chat/completions", json=chat(), headers=auth(session)), 409)
        assert error["code"] == "episode_ended" and "during this call" in error["message"]
        assert len(fake.requests) == 1 and session.calls == []

    serve(test)
