"""The gateway's HTTP server (mas_async/gateway/server.py) on a real socket, with a fake `generate` that
records every request: OpenAI's response shape with exact tokens, the sampling rules, and an OpenAI-shaped
error (never a crash or a hang) for every request it refuses."""

from __future__ import annotations

import json

import httpx
import pytest

from mas_async.gateway.server import Gateway
from mas_async.gateway.session import Session
from mas_async.tiny_model import IM_END_ID, build_tokenizer
from tests.unit.gateway.fakes import FakeInference, auth, chat, refused, serve


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
                           "max_tokens": 4, "temperature": 1.0, "seed": None, "top_logprobs": 0}  # fmt: skip
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


def test_every_refusal_is_an_openai_error_and_the_gateway_keeps_serving() -> None:
    async def test(gateway: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        post = http.post
        h = auth(session)
        error = refused(await post("/chat/completions", content=b"{not json", headers=h), 400)
        assert "not valid JSON" in error["message"]
        error = refused(await post("/chat/completions", json=chat(model="diagonal"), headers=h), 404)
        assert error["code"] == "model_not_found" and "vertical" in error["message"]
        assert refused(await post("/chat/completions", json=chat()), 401)["code"] == "invalid_api_key"
        bad_key = {"Authorization": "Bearer mas-nothing"}
        assert refused(await post("/chat/completions", json=chat(), headers=bad_key), 401)["code"] == "invalid_api_key"
        assert refused(await post("/chat/completions", json=chat(n=5), headers=h), 400)["param"] == "n"
        assert (
            refused(await post("/chat/completions", json=chat(max_tokens=9), headers=h), 400)["param"] == "max_tokens"
        )
        error = refused(await post("/chat/completions", json=chat(temperature=0.5), headers=h), 400)
        assert error["param"] == "temperature" and "off-policy" in error["message"]
        assert refused(await post("/chat/completions", json=chat(top_p=0.9), headers=h), 400)["param"] == "top_p"
        options = chat(stream_options={"include_usage": True})  # without stream=true
        assert refused(await post("/chat/completions", json=options, headers=h), 400)["param"] == "stream_options"
        assert refused(await post("/chat/completions", json=chat(tools=[{}]), headers=h), 400)["param"] == "tools[0]"
        error = refused(await post("/chat/completions", json=chat(tool_choice="required"), headers=h), 400)
        assert error["param"] == "tool_choice" and "constrained decoding" in error["message"]
        bad_call = chat()
        bad_call["messages"] += [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]
        assert (
            refused(await post("/chat/completions", json=bad_call, headers=h), 400)["param"] == "messages[1].tool_calls"
        )
        assert refused(await post("/chat/completions", json=chat(bogus=1), headers=h), 400)["param"] == "bogus"
        assert (
            refused(await post("/chat/completions", json={"model": "vertical"}, headers=h), 400)["param"] == "messages"
        )
        refused(await post("/chat/completions", json=[1, 2], headers=h), 400)
        refused(await post("/chat/completions", content=b"x" * (65 * 1024), headers=h), 413)
        refused(await http.get("/nowhere", headers=h), 404)
        refused(await http.get("/chat/completions", headers=h), 405)
        assert fake.requests == [] and session.calls == [] and session.requests == 0  # nothing reached inference
        fake.fail = "generate request 5 to policy 'pv' timed out after 1s"
        error = refused(await post("/chat/completions", json=chat(), headers=h), 500)
        assert error["type"] == "server_error" and "timed out" in error["message"]
        fake.fail = "Generate.prompt_ids: 600 tokens + max_tokens 8 exceed the model's 512 positions"
        assert "512 positions" in refused(await post("/chat/completions", json=chat(), headers=h), 400)["message"]
        fake.fail = None
        for _ in range(session.max_calls - session.requests):
            assert (await post("/chat/completions", json=chat(), headers=h)).status_code == 200
        assert refused(await post("/chat/completions", json=chat(), headers=h), 400)["code"] == "episode_call_limit"
        gateway.close(session)
        assert refused(await post("/chat/completions", json=chat(), headers=h), 409)["code"] == "episode_ended"
        assert refused(await http.get("/models", headers=h), 409)["code"] == "episode_ended"

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
        assert refused(await http.post("/chat/completions", json=chat(temperature=1.5), headers=h), 400)

    serve(test, mode="eval")


def test_a_call_in_flight_when_its_episode_ends_is_refused_and_not_recorded() -> None:
    async def test(gateway: Gateway, session: Session, fake: FakeInference, http: httpx.AsyncClient) -> None:
        fake.during = lambda: gateway.close(session)
        error = refused(await http.post("/chat/completions", json=chat(), headers=auth(session)), 409)
        assert error["code"] == "episode_ended" and "during this call" in error["message"]
        assert len(fake.requests) == 1 and session.calls == []

    serve(test)
