"""The gateway's HTTP server: the OpenAI chat completions API on the env worker's own event loop.

Routes: `POST /v1/chat/completions` (non-streaming) and `GET /v1/models`. A request is authenticated by
its per-episode key (`session.py`), `model` names an agent, and the prompt is the agent's policy's chat
template applied to the messages, reusing the exact ids of earlier turns (`transcript.py`). It then goes
to the router as one `Generate` of the agent's policy (n choices from one request) through the env
worker's `generate`, so it is balanced, gated by the weight version and tagged like any other request.
Each choice carries the usual fields plus `token_ids`, `prompt_token_ids` and `weight_version`.

Why aiohttp: its server runs as tasks of the loop that already runs the worker's episodes and sockets
(no thread, no second loop), its handlers are plain coroutines with no request-model layer of its own,
so every error the gateway returns is built here in OpenAI's shape, and it is a small, long-maintained
dependency. (FastAPI + uvicorn would add a validation layer whose 422 errors are not OpenAI-shaped, and
uvicorn's server would still have to be embedded in this loop.)

Sampling follows the run, so that a training sample is on-policy: in training, `temperature` must be
left out or equal `rollout.temperature` (the trainer recomputes log-probs at it), `top_p` left out or 1,
and `max_tokens` at most `rollout.max_tokens`; `n` is at most `algorithm.k`. In evaluation a request may
lower the temperature (0: greedy; left out: greedy when `eval.greedy`). `stop` strings end a choice at the
token that completes the first of them: its ids stop there, its content stops before the string. `seed`
is accepted and not applied per request (each replica samples from its own seeded generator).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from mas_async.gateway.errors import GatewayError, bad_request
from mas_async.gateway.requests import ChatRequest
from mas_async.gateway.session import Call, Session, Sessions

if TYPE_CHECKING:
    from mas_async.wire.samples import Completion

log = logging.getLogger("mas_async.gateway")

# generate(policy, prompt_ids int32[P], n, greedy, max_tokens=..., temperature=...) -> n completions.
Generate = Callable[..., Awaitable[list["Completion"]]]
STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Limits:
    """What a request may ask (from the run's config: `Limits.of`)."""

    max_n: int
    max_tokens: int
    temperature: float
    eval_greedy: bool
    max_calls: int
    max_request_bytes: int

    @classmethod
    def of(cls, config: Any) -> Limits:
        return cls(
            max_n=config.algorithm.k,
            max_tokens=config.rollout.max_tokens,
            temperature=config.rollout.temperature,
            eval_greedy=config.eval.greedy,
            max_calls=config.gateway.max_calls_per_episode,
            max_request_bytes=config.gateway.max_request_bytes,
        )


class Gateway:
    """The OpenAI-compatible endpoint of one env worker: sessions, the HTTP app, and its lifecycle."""

    def __init__(
        self,
        *,
        policy_of: dict[str, str],
        tokenizers: dict[str, Any],
        generate: Generate,
        limits: Limits,
        template_kwargs: dict[str, dict[str, Any]] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        generate_errors: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.policy_of = dict(policy_of)
        self.tokenizers = tokenizers
        self.generate = generate
        self.limits = limits
        self.template_kwargs = dict(template_kwargs or {})
        self.host = host
        self.port = port
        self.generate_errors = generate_errors
        """Exceptions of `generate` that mean the inference side refused or failed the request (-> an error reply)."""
        self.sessions = Sessions()
        self.base_url = ""
        """http://host:port/v1 once started."""
        self.app = web.Application(middlewares=[_openai_errors], client_max_size=limits.max_request_bytes)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/v1/models", self.models)
        self._runner: web.AppRunner | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> str:
        """Serve on host:port (port 0: a free one); returns the base URL, .../v1."""
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        host, port = self._runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}/v1"
        log.info("OpenAI gateway serving at %s", self.base_url)
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await asyncio.wait_for(self._runner.cleanup(), STOP_TIMEOUT_S)
            self._runner = None

    def open(self, *, episode_id: str, problem_id: str, mode: str) -> Session:
        """A new session for one episode; its key is the API key of the episode's clients."""
        return self.sessions.add(
            episode_id=episode_id,
            problem_id=problem_id,
            mode=mode,
            policy_of=self.policy_of,
            tokenizers=self.tokenizers,
            template_kwargs=self.template_kwargs,
            max_calls=self.limits.max_calls,
        )

    def close(self, session: Session) -> None:
        self.sessions.close(session)

    # -- routes ------------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        self._session(request)
        data = [{"id": a, "object": "model", "created": 0, "owned_by": p} for a, p in self.policy_of.items()]
        return web.json_response({"object": "list", "data": data})

    async def chat_completions(self, request: web.Request) -> web.Response:
        session = self._session(request)
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
            raise bad_request(f"the request body is not valid JSON: {e}") from None
        chat = ChatRequest.parse(body)
        agent = chat.model
        if agent not in self.policy_of:
            raise GatewayError(
                404,
                f"The model {agent!r} does not exist: model names an agent of the run "
                f"({', '.join(sorted(self.policy_of))})",
                param="model",
                code="model_not_found",
            )
        greedy, temperature, max_tokens = self._sampling(chat, session.mode)
        policy = self.policy_of[agent]
        try:
            prompt_ids, source = session.transcript(agent).prompt(chat.messages)
        except Exception as e:  # a template that cannot render these messages (jinja raises its own errors)
            raise bad_request(f"the chat template of policy {policy!r} cannot render these messages: {e}") from None
        turn = session.admit(agent)
        session.sources[(agent, source)] += 1
        try:
            completions = await self.generate(
                policy, prompt_ids, chat.n, greedy, max_tokens=max_tokens, temperature=temperature
            )
        except self.generate_errors as e:
            message = str(e)
            if message.startswith("Generate."):  # the server found a value out of range (inference/limits.py)
                raise bad_request(f"the inference server refused the request: {message}") from None
            raise GatewayError(500, f"inference failed: {message}", type="server_error") from None
        if session.closed:
            raise GatewayError(409, f"episode {session.episode_id} ended during this call", code="episode_ended")
        tokenizer = self.tokenizers[policy]
        choices = []
        for index, completion in enumerate(completions):
            completion, text = _apply_stop(tokenizer, completion, chat.stop)
            session.calls.append(Call(agent, policy, turn, index, prompt_ids, completion, text, source))
            session.transcript(agent).add(chat.messages, text, prompt_ids, np.asarray(completion.token_ids))
            choices.append(_choice(tokenizer, index, text, completion, prompt_ids, chat.logprobs))
        generated = sum(len(c.token_ids) for c in completions)
        return web.json_response(
            {
                "id": f"chatcmpl-{secrets.token_hex(12)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": agent,
                "choices": choices,
                "usage": {
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": generated,
                    "total_tokens": len(prompt_ids) + generated,
                },
                "mas_async": {
                    "episode_id": session.episode_id,
                    "agent": agent,
                    "turn": turn,
                    "prompt_source": source,
                },
            }
        )

    # -- helpers -----------------------------------------------------------------------------------

    def _session(self, request: web.Request) -> Session:
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        return self.sessions.get(key.strip() if scheme.lower() == "bearer" else None)

    def _sampling(self, chat: ChatRequest, mode: str) -> tuple[bool, float, int]:
        """(greedy, temperature, max_tokens) of a request in an episode of `mode`, or a 400 naming the field."""
        lim = self.limits
        if chat.n > lim.max_n:
            raise bad_request(f"n={chat.n} is above this run's K (algorithm.k={lim.max_n})", param="n")
        max_tokens = lim.max_tokens if chat.max_tokens is None else chat.max_tokens
        if max_tokens > lim.max_tokens:
            raise bad_request(
                f"max_tokens={max_tokens} is above this run's rollout.max_tokens={lim.max_tokens}", param="max_tokens"
            )
        if chat.top_p is not None and chat.top_p != 1.0:
            raise bad_request(
                f"top_p={chat.top_p}: this run samples the full distribution (the log-probs it trains on ignore a "
                "nucleus cut); leave top_p out or set it to 1",
                param="top_p",
            )
        if mode == "train":
            if chat.temperature is not None and chat.temperature != lim.temperature:
                raise bad_request(
                    f"temperature={chat.temperature}: this run trains at rollout.temperature={lim.temperature} (the "
                    "trainer recomputes log-probs at it, so a sample at another temperature would be off-policy); "
                    "leave temperature out",
                    param="temperature",
                )
            return False, lim.temperature, max_tokens
        if chat.temperature is None:
            return lim.eval_greedy, lim.temperature, max_tokens
        if chat.temperature > lim.temperature:
            raise bad_request(
                f"temperature={chat.temperature} is above this run's rollout.temperature={lim.temperature}",
                param="temperature",
            )
        return chat.temperature == 0.0, chat.temperature or lim.temperature, max_tokens


def _apply_stop(tokenizer: Any, completion: Completion, stops: list[str] | None) -> tuple[Completion, str]:
    """The completion cut at the token that completes the first stop string, and its content (before it)."""
    ids = np.asarray(completion.token_ids).tolist()
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not stops or not any(s in text for s in stops):
        return completion, text
    for end in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:end], skip_special_tokens=True)
        hits = [i for i in (prefix.find(s) for s in stops) if i >= 0]
        if hits:
            cut = type(completion)(
                np.asarray(completion.token_ids[:end]),
                np.asarray(completion.logprobs[:end]),
                completion.version,
                "stop",
            )
            return cut, prefix[: min(hits)]
    return completion, text  # unreachable: the whole text holds a stop string


def _choice(
    tokenizer: Any, index: int, text: str, completion: Completion, prompt_ids: np.ndarray, logprobs: bool
) -> dict[str, Any]:
    ids = np.asarray(completion.token_ids).tolist()
    choice: dict[str, Any] = {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "finish_reason": "stop" if completion.finish_reason == "stop" else "length",
        "logprobs": None,
        "token_ids": ids,
        "prompt_token_ids": np.asarray(prompt_ids).tolist(),
        "weight_version": int(completion.version),
    }
    if logprobs:
        content = []
        for token, lp in zip(ids, np.asarray(completion.logprobs).tolist(), strict=True):
            piece = tokenizer.decode([token], skip_special_tokens=False)
            content.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []})
        choice["logprobs"] = {"content": content}
    return choice


@web.middleware
async def _openai_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Every refusal as an OpenAI error object; an unexpected exception is logged and answered with a 500."""
    try:
        return await handler(request)
    except GatewayError as e:
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:  # no such route (404), method (405), a body over the limit (413)
        error = GatewayError(e.status, f"{request.method} {request.path}: {e.reason}")
        return web.json_response(error.body(), status=e.status)
    except Exception as e:
        log.exception("gateway: %s %s failed", request.method, request.path)
        error = GatewayError(500, f"internal error of the gateway: {type(e).__name__}: {e}", type="server_error")
        return web.json_response(error.body(), status=500)
