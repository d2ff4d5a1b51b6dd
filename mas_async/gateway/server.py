"""The gateway's HTTP server: the OpenAI API on the env worker's own event loop.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (legacy text completions), `POST /v1/responses`
(the Responses API, read as the chat request it is: `responses_api.py`) and `GET /v1/models`; both
completion routes answer in one JSON object or, with `stream: true`, as server-sent
events (`streaming.py`). A request is authenticated by its per-episode key (`session.py`), and on a
gateway served outside the run (`gateway.external`) first by the run's token (`access.py`); `model` names
an agent. A chat prompt is the agent's policy's chat template applied to the messages and tools,
reusing the exact ids of earlier turns (`transcript.py`); a text prompt is the tokenizer's encoding of
the text, or the given ids (`completions.py`). The prompt then goes to the router as one `Generate` of the
agent's policy (n choices from one request) through the env worker's `generate`, so it is balanced,
gated by the weight version and tagged like any other request, under the run's sampling rules
(`sampling.py`). Every choice is recorded as the agent's turn before the response is sent, and carries
the usual fields plus `token_ids`, `prompt_token_ids` and `weight_version` (`responses.py`); a chat
reply's Hermes tool calls become `message.tool_calls` (`tools.py`). In a tree-sampled training episode a
chat call is K candidates from one request, scored by the program's scorer, and only the best is returned
and continues the agent's transcript (`tree.py`). The clients a program is given skip HTTP: they call
`Gateway.answer`, which checks and answers their calls as the routes do (`in_process.py`).

Why aiohttp: its server runs as tasks of the loop that already runs the worker's episodes and sockets
(no thread, no second loop; only a huge prompt is tokenised on a thread, `_off_loop`), its handlers are
plain coroutines with no request-model layer of its own,
so every error the gateway returns is built here in OpenAI's shape, and it is a small, long-maintained
dependency. (FastAPI + uvicorn would add a validation layer whose 422 errors are not OpenAI-shaped, and
uvicorn's server would still have to be embedded in this loop.) A request that aiohttp's own HTTP parser
refuses is answered in OpenAI's shape too, quoting none of it (`http.py`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from aiohttp import web

from mas_async.deployment import http_url
from mas_async.gateway import responses, responses_api, streaming
from mas_async.gateway.access import Access
from mas_async.gateway.completions import TextRequest
from mas_async.gateway.errors import GatewayError, bad_request
from mas_async.gateway.http import Runner
from mas_async.gateway.loading import load_scorer
from mas_async.gateway.requests import ChatRequest, Sampling
from mas_async.gateway.responses_api import ResponsesRequest
from mas_async.gateway.sampling import Decoding, Limits, apply_stop, decoding
from mas_async.gateway.session import Call, Session, Sessions
from mas_async.gateway.tree import ScoreError, TreeSampling, best, score_candidates

if TYPE_CHECKING:
    from mas_async.wire.samples import Completion

__all__ = ["Gateway", "Generate", "Limits"]

log = logging.getLogger("mas_async.gateway")

# generate(policy, prompt_ids int32[P], n, greedy, max_tokens=..., temperature=..., seed=..., top_logprobs=...)
# -> n completions (seed None: the server's generator; top_logprobs 0: no alternatives).
Generate = Callable[..., Awaitable[list["Completion"]]]
STOP_TIMEOUT_S = 5.0
OFF_LOOP_CHARS = 64 * 1024
"""A prompt of this many characters or more is rendered and tokenised off the event loop (`Gateway._off_loop`)."""
T = TypeVar("T")
ROUTES = {"chat": "/v1/chat/completions", "text": "/v1/completions", "responses": "/v1/responses"}
"""The POST route of each kind of call that `Gateway.answer` takes in-process."""


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
        access: Access | None = None,
        in_process: bool = True,
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
        self.access = access or Access()
        """Who may call (`access.py`): the episode key alone (loopback), or the run's token with it (external)."""
        self.in_process = in_process
        """Whether the episodes' program clients call `answer` in-process (`in_process.py`) rather than over HTTP."""
        self.scorer = load_scorer(limits.tree.scorer) if limits.tree is not None else None
        """The run's `workflow.scorer` under tree sampling (`tree.py`): each training episode binds it to its task."""
        self.sessions = Sessions()
        self.base_url = ""
        """http://host:port/v1 once started."""
        self.app = web.Application(middlewares=[_openai_errors, self._admit], client_max_size=limits.max_request_bytes)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/responses", self.create_response)
        self.app.router.add_get("/v1/models", self.models)
        self._runner: Runner | None = None
        self._prompts: ThreadPoolExecutor | None = None
        """The thread that builds the prompts of huge requests (`_off_loop`), made on the first one."""
        self.clients_http: Any = None
        """The connection pool that the episodes' openai clients share (from `start`): building one per
        client would cost an SSL context each, ~26 ms of CPU."""

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> str:
        """Serve on host:port (port 0: a free one); returns the base URL, .../v1."""
        self._runner = Runner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        # An external gateway binds its port with SO_REUSEPORT: the launcher holds it for the run so that no
        # other user's process can take it first and be sent the run's token (`deployment.hold_ports`).
        await web.TCPSite(self._runner, self.host, self.port, reuse_port=self.access.external or None).start()
        host, port = self._runner.addresses[0][:2]
        self.base_url = http_url(host, port, "/v1")
        self.clients_http = programs_http()
        log.info("OpenAI gateway serving at %s%s", self.base_url, " (the run's token required)" * self.access.external)
        return self.base_url

    async def stop(self) -> None:
        if self.clients_http is not None:
            await asyncio.wait_for(self.clients_http.aclose(), STOP_TIMEOUT_S)
            self.clients_http = None
        if self._runner is not None:
            await asyncio.wait_for(self._runner.cleanup(), STOP_TIMEOUT_S)
            self._runner = None
        if self._prompts is not None:
            self._prompts.shutdown(wait=False, cancel_futures=True)
            self._prompts = None

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

    def api_key(self, session: Session) -> str:
        """The API key of `session`'s clients: its key, after the run's token on an external gateway."""
        return self.access.api_key(session.key)

    # -- routes ------------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        self._session(request)
        data = [{"id": a, "object": "model", "created": 0, "owned_by": p} for a, p in self.policy_of.items()]
        return web.json_response({"object": "list", "data": data})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        chat = ChatRequest.parse(await _body(request))
        response = await self.chat(session, chat)
        deltas = responses.chat_deltas(self.tokenizers[self.policy_of[chat.model]])
        return await _reply(request, response, chat.sampling, "chat.completion.chunk", deltas, {"delta": {}})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        text_request = TextRequest.parse(await _body(request))
        response = await self.text(session, text_request)
        deltas = responses.text_deltas(self.tokenizers[self.policy_of[text_request.model]])
        return await _reply(request, response, text_request.sampling, "text_completion", deltas, {"text": ""})

    async def create_response(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        return web.json_response(await self.respond(session, ResponsesRequest.parse(await _body(request))))

    async def answer(self, route: str, authorization: str, data: str) -> dict[str, Any]:
        """An in-process client's call (`in_process.py`): the JSON body `data` of a chat ("chat") or text
        ("text") completion request, or a Responses API one ("responses"), with its Authorization header,
        checked in the order of an HTTP request (the run's token, the episode, the body's size and JSON, its
        fields); the response object, or the `GatewayError` that the HTTP route would have answered."""
        try:
            self.access.admit(authorization, "this process")
            session = self.sessions.get(self.access.episode_key(authorization), authenticated=self.access.external)
            size = len(data.encode())
            if size > self.limits.max_request_bytes:
                path = ROUTES[route]
                too_large = web.HTTPRequestEntityTooLarge(max_size=self.limits.max_request_bytes, actual_size=size)
                raise GatewayError(413, f"POST {path}: {too_large.reason}")
            body = _parse_json(data)
            if route == "chat":
                response = await self.chat(session, ChatRequest.parse(body))
            elif route == "responses":
                response = await self.respond(session, ResponsesRequest.parse(body))
            else:
                response = await self.text(session, TextRequest.parse(body))
            session.in_process[response["model"]] += 1
            return response
        except GatewayError:
            raise
        except Exception as e:  # (as the HTTP middleware answers it)
            log.exception("gateway: an in-process %s completion failed", route)
            raise GatewayError(
                500, f"internal error of the gateway: {type(e).__name__}: {e}", type="server_error"
            ) from e

    # -- what a route does, whoever asks (the HTTP routes above, or an in-process client's `answer`) -------

    async def chat(self, session: Session, chat: ChatRequest) -> dict[str, Any]:
        """Answer a chat request of `session`: the response object (streamed or not by the caller)."""
        agent, policy = self._agent(chat.model)
        decode = decoding(chat.sampling, session.mode, self.limits)
        tree = self._tree(session)
        if tree is not None and chat.sampling.n > 1:
            raise bad_request(
                f"n={chat.sampling.n}: under algorithm.sampling=tree each training call is sampled as "
                f"algorithm.k={tree.k} candidates, scored by workflow.scorer, and the best one is returned; ask "
                "one choice (leave n out)",
                param="n",
            )
        transcript = session.transcript(agent)
        try:
            if chat.tools and not transcript.renders_tools():
                raise bad_request(
                    f"tools: the chat template of policy {policy!r} does not render tools (it ignores the tools "
                    "argument), so the model could not see them; use a model whose template supports tools",
                    param="tools",
                )
            chars = sum(len(m["content"]) for m in chat.messages) + (len(json.dumps(chat.tools)) if chat.tools else 0)
            prompt = await self._off_loop(chars, transcript.prompt, chat.messages, chat.tools)
        except GatewayError:
            raise
        except Exception as e:  # a template that cannot render these messages (jinja raises its own errors)
            raise bad_request(f"the chat template of policy {policy!r} cannot render these messages: {e}") from None
        n = chat.sampling.n if tree is None else tree.k
        prompt_ids, source = prompt.ids, prompt.source
        turn, outputs, calls = await self._sample(session, agent, prompt_ids, source, chat.sampling, decode, n)
        tokenizer = self.tokenizers[policy]
        choices = [
            responses.chat_choice(
                tokenizer, index, text, completion, prompt_ids, chat.sampling.logprobs, chat.parses_tools
            )
            for index, (completion, text) in enumerate(outputs)
        ]
        about = _about(session, agent, turn, source)
        if tree is not None:
            chosen = await self._choose(session, tree, agent, turn, chat.messages, choices, calls)
            about["tree"] = {"scores": [c.score for c in calls], "chosen": chosen}
            choices, outputs = [{**choices[chosen], "index": 0}], [outputs[chosen]]
        session.calls += calls
        for choice, (completion, _) in zip(choices, outputs, strict=True):
            transcript.add(chat.messages, choice["message"], prompt, np.asarray(completion.token_ids), chat.tools)
        return responses.envelope("chat.completion", agent, choices, prompt_ids, about)

    async def respond(self, session: Session, request: ResponsesRequest) -> dict[str, Any]:
        """Answer a Responses API request of `session` (`responses_api.py`): read as the chat request it
        is, after the stored conversation of its `previous_response_id`; its response stored unless `store`
        is false."""
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            stored = session.responses.get(request.previous_response_id)
            if stored is None:
                raise responses_api.not_found(request.previous_response_id)
            history = stored
        completion = await self.chat(session, request.chat(history))
        response_id = responses_api.new_id()
        response = responses_api.response_object(request, completion, response_id, request.store)
        if request.store:
            (choice,) = completion["choices"]
            session.responses[response_id] = request.conversation(history, choice["message"])
        return response

    async def text(self, session: Session, text_request: TextRequest) -> dict[str, Any]:
        """Answer a text completion request of `session`: the response object."""
        agent, policy = self._agent(text_request.model)
        sampling = text_request.sampling
        decode = decoding(sampling, session.mode, self.limits)
        if self._tree(session) is not None:
            raise bad_request(
                "/v1/completions is not served in training under algorithm.sampling=tree: each training call is "
                "sampled as algorithm.k candidates and workflow.scorer scores them against a chat call's "
                "messages; use chat completions (or algorithm.sampling=parallel)"
            )
        tokenizer = self.tokenizers[policy]
        chars = len(text_request.prompt) if isinstance(text_request.prompt, str) else 0
        prompt_ids = await self._off_loop(chars, text_request.prompt_ids, tokenizer)
        turn, outputs, calls = await self._sample(session, agent, prompt_ids, "fresh", sampling, decode, sampling.n)
        session.calls += calls
        choices = [
            responses.text_choice(tokenizer, index, text, completion, prompt_ids, sampling.logprobs)
            for index, (completion, text) in enumerate(outputs)
        ]
        return responses.envelope("text_completion", agent, choices, prompt_ids, _about(session, agent, turn, "fresh"))

    # -- helpers -----------------------------------------------------------------------------------

    async def _off_loop(self, chars: int, build: Callable[..., T], *args: Any) -> T:
        """`build(*args)`, a prompt's rendering and tokenising: inline for a prompt under `OFF_LOOP_CHARS`
        characters, else on the gateway's one prompt thread, so that a huge request (megabytes of text take
        seconds to tokenise) does not stall every episode on the worker's event loop meanwhile (the fast
        tokenizers release the GIL while they encode)."""
        if chars < OFF_LOOP_CHARS:
            return build(*args)
        if self._prompts is None:
            self._prompts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-prompts")
        return await asyncio.get_running_loop().run_in_executor(self._prompts, functools.partial(build, *args))

    @web.middleware
    async def _admit(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """On an external gateway, a request without the run's token is refused here, before any route
        (an unknown route or method included) or its body is read."""
        self.access.admit(request.headers.get("Authorization", ""), request.remote)
        return await handler(request)

    def _session(self, request: web.Request) -> Session:
        key = self.access.episode_key(request.headers.get("Authorization", ""))
        return self.sessions.get(key, authenticated=self.access.external)

    def _agent(self, model: str) -> tuple[str, str]:
        """(agent, its policy) named by a request's `model`, or a 404 listing the agents."""
        if model not in self.policy_of:
            raise GatewayError(
                404,
                f"The model {model!r} does not exist: model names an agent of the run "
                f"({', '.join(sorted(self.policy_of))})",
                param="model",
                code="model_not_found",
            )
        return model, self.policy_of[model]

    async def _sample(
        self,
        session: Session,
        agent: str,
        prompt_ids: np.ndarray,
        source: str,
        sampling: Sampling,
        decode: Decoding,
        n: int,
    ) -> tuple[int, list[tuple[Completion, str]], list[Call]]:
        """Take the agent's turn, sample n choices of `prompt_ids` in one request and cut them at the stop
        strings; returns the turn, the (completion, text) of each choice and its `Call`, for the route to
        record once the call is answered."""
        policy = self.policy_of[agent]
        turn = session.admit(agent)
        session.sources[(agent, source)] += 1
        try:
            request = self.generate(
                policy,
                prompt_ids,
                n,
                decode.greedy,
                max_tokens=decode.max_tokens,
                temperature=decode.temperature,
                seed=decode.seed,
                top_logprobs=decode.top_logprobs,
            )
            completions = await asyncio.create_task(request, context=session.context.copy())
        except self.generate_errors as e:
            session.release(agent, turn, source)  # no sample: a retry is this turn again, not the next one
            message = str(e)
            if message.startswith("Generate."):  # the server found a value out of range (inference/limits.py)
                raise bad_request(f"the inference server refused the request: {message}") from None
            raise GatewayError(500, f"inference failed: {message}", type="server_error") from None
        if session.closed:
            raise GatewayError(409, f"episode {session.episode_id} ended during this call", code="episode_ended")
        outputs = [apply_stop(self.tokenizers[policy], c, sampling.stop) for c in completions]
        calls = [
            Call(agent, policy, turn, index, prompt_ids, completion, text, source)
            for index, (completion, text) in enumerate(outputs)
        ]
        return turn, outputs, calls

    def _tree(self, session: Session) -> TreeSampling | None:
        """The tree sampling of `session`'s calls: a training episode's when the run tree-samples (the
        episode then binds the scorer to its task); else None."""
        return self.limits.tree if session.score is not None else None

    async def _choose(
        self,
        session: Session,
        tree: TreeSampling,
        agent: str,
        turn: int,
        messages: list[dict[str, Any]],
        choices: list[dict[str, Any]],
        calls: list[Call],
    ) -> int:
        """Score the K candidates of a tree-sampled call (`tree.py`), mark their Calls, and return the index
        of the best; a scorer's failure fails the episode (a 500 now, every later call refused)."""
        assert session.score is not None
        where = f"turn {turn} of agent {agent!r} (episode {session.episode_id})"
        try:
            scores = await score_candidates(
                session.score,
                agent,
                messages,
                [choice["message"] for choice in choices],
                timeout_s=tree.timeout_s,
                context=session.context,
                turn=turn,
                where=where,
            )
        except ScoreError as e:
            session.failure = str(e)  # (the env worker logs the episode's failure)
            raise GatewayError(500, f"the episode failed: {e}", type="server_error", code="scorer_failed") from None
        if session.closed:
            raise GatewayError(409, f"episode {session.episode_id} ended during this call", code="episode_ended")
        chosen = best(scores)
        for index, (call, score) in enumerate(zip(calls, scores, strict=True)):
            call.score, call.chosen = score, index == chosen
        return chosen


async def _reply(
    request: web.Request,
    response: dict[str, Any],
    sampling: Sampling,
    kind: str,
    deltas: Callable[[dict[str, Any]], Iterable[dict[str, Any]]],
    empty: dict[str, Any],
) -> web.StreamResponse:
    """`response` as one JSON object, or with `stream: true` as server-sent chunks of `kind` (`streaming.py`)."""
    if not sampling.stream:
        return web.json_response(response)
    return await streaming.send(request, streaming.chunks(response, kind, deltas, empty, sampling.include_usage))


async def _body(request: web.Request) -> Any:
    return _parse_json(await request.read())


def _parse_json(data: bytes | str) -> Any:
    try:
        return json.loads(data)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # (the decoder's bound on nesting, far above any request's)
        raise bad_request("the request body is not valid JSON: it nests deeper than the decoder reads") from None


def programs_http() -> Any:
    """The HTTP client that the openai clients of the episodes' programs share: the openai package's own
    client over aiohttp's transport (`DefaultAioHttpClient`), whose HTTP/1.1 is parsed in C, where its
    default's (httpcore) is pure Python: it takes a sixth off the env worker's CPU per call (docs/gateway.md,
    "What a call costs"). No proxy from the environment: the gateway is this process's own."""
    from openai import DefaultAioHttpClient  # (the openai package is a program run's only)

    return DefaultAioHttpClient(trust_env=False)


def _about(session: Session, agent: str, turn: int, source: str) -> dict[str, Any]:
    """The response's `mas_async` object: which episode, agent and turn the call was, and its prompt source."""
    return {"episode_id": session.episode_id, "agent": agent, "turn": turn, "prompt_source": source}


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
