"""The clients of a workflow program that runs in the env worker: `openai.AsyncOpenAI` clients whose
chat and text completions reach the episode's gateway in the same process, without HTTP.

A program's calls are made in the process that serves its gateway, so sending each one through HTTP (the
`openai` package's request transform and HTTP client, aiohttp's server, JSON both ways) costs the env
worker more CPU than the rest of the call (docs/gateway.md, "What a call costs"). `InProcessClient` is an
`openai.AsyncOpenAI` (every attribute, resource and helper of the package is there) whose
`chat.completions.create`, `completions.create` and `responses.create` hand a plain call straight to
`Gateway.answer`: the same request body (the call's arguments as the package would send them, as JSON),
the same checks, session, exact tokens and router, the same response object and, for a refusal, the same
`openai` exception, status, message and body. Extra headers other than `Authorization` (the OpenAI Agents
SDK sends its User-Agent with every call) mean nothing to the gateway and stay in-process. Anything else
goes over HTTP as from any client: streaming, raw responses, an `Authorization` header, `extra_query`, a per-call
`timeout`, `response_format`, arguments the package does not know, values JSON cannot hold, a copy pointed
at another base URL, and every other resource (`models.list()`, ...).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from functools import cached_property
from typing import TYPE_CHECKING, Any

from openai import APITimeoutError, AsyncOpenAI, NotGiven, Omit
from openai.resources.chat import AsyncChat
from openai.resources.chat.completions import AsyncCompletions as AsyncChatCompletions
from openai.resources.completions import AsyncCompletions as AsyncTextCompletions
from openai.resources.responses import AsyncResponses
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from pydantic import BaseModel, ValidationError

from mas_async.gateway.errors import GatewayError

try:
    import httpx2 as httpx  # (what the openai package speaks since 3.x)
except ImportError:  # pragma: no cover - an openai release on httpx
    import httpx

if TYPE_CHECKING:
    from mas_async.gateway.server import Gateway

__all__ = ["InProcessClient"]

PASSED_OVER_HTTP = frozenset({"stream", "extra_query", "timeout", "response_format"})
"""Arguments whose call goes over HTTP when given (not None, False or omitted); `extra_headers` too when
they set `Authorization` (`_headers_matter`)."""
ROUTES = {"chat": "/chat/completions", "text": "/completions", "responses": "/responses"}
REQUEST_OPTIONS = frozenset({"extra_headers", "extra_query", "extra_body", "timeout"})
"""Arguments that are the package's options of the request, not fields of its body."""
NEEDED = {"chat": ("model", "messages"), "text": ("model",), "responses": ("model",)}
"""Arguments without which a call is left to the package (which raises its own error for it)."""


class InProcessClient(AsyncOpenAI):
    """An `openai.AsyncOpenAI` of `gateway` whose plain completion calls skip HTTP (module docstring)."""

    gateway: Gateway | None = None

    def bind(self, gateway: Gateway) -> InProcessClient:
        """Answer this client's plain calls in-process by `gateway` (whose base URL the client has), on the
        running event loop (the gateway's)."""
        self.gateway = gateway
        self._bound_to = (self.base_url, asyncio.get_running_loop())
        return self

    def copy(self, **kwargs: Any) -> InProcessClient:
        client = super().copy(**kwargs)
        if self.gateway is not None:
            client.gateway, client._bound_to = self.gateway, self._bound_to
        return client

    with_options = copy

    @cached_property
    def chat(self) -> AsyncChat:
        return _Chat(self)

    @cached_property
    def completions(self) -> AsyncTextCompletions:
        return _TextCompletions(self)

    @cached_property
    def responses(self) -> AsyncResponses:
        return _Responses(self)

    def in_process(self) -> Gateway | None:
        """The gateway that answers this client's plain calls, None when they go over HTTP: an unbound client,
        a copy with another base URL, or a call made on another event loop than the gateway's."""
        if self.gateway is None or self._bound_to != (self.base_url, asyncio.get_running_loop()):
            return None
        return self.gateway


class _Chat(AsyncChat):
    @cached_property
    def completions(self) -> AsyncChatCompletions:
        return _ChatCompletions(self._client)


class _ChatCompletions(AsyncChatCompletions):
    async def create(self, **kwargs: Any) -> Any:
        response = await _answer(self._client, "chat", kwargs, AsyncChatCompletions.create)
        if response is None:
            return await super().create(**kwargs)
        return _model(ChatCompletion, response)


class _TextCompletions(AsyncTextCompletions):
    async def create(self, **kwargs: Any) -> Any:
        response = await _answer(self._client, "text", kwargs, AsyncTextCompletions.create)
        if response is None:
            return await super().create(**kwargs)
        return _model(Completion, response)


class _Responses(AsyncResponses):
    async def create(self, **kwargs: Any) -> Any:
        response = await _answer(self._client, "responses", kwargs, AsyncResponses.create)
        if response is None:
            return await super().create(**kwargs)
        return _model(Response, response)


@functools.cache
def _parameters(method: Any) -> frozenset[str]:
    """The keyword arguments a package method takes (read once from its signature)."""
    return frozenset(inspect.signature(method).parameters) - {"self"}


async def _answer(client: Any, route: str, kwargs: dict[str, Any], method: Any) -> dict[str, Any] | None:
    """The response object of an in-process call, the `openai` exception of a refusal, or None when the
    call is to go over HTTP (the package then does all it does, errors included)."""
    gateway = client.in_process()
    if gateway is None or any(k not in kwargs for k in NEEDED[route]):
        return None
    if not isinstance(client.api_key, str):  # (a key provider: the package resolves it per request)
        return None
    if not kwargs.keys() <= _parameters(method):
        return None
    if any(_given(kwargs[k]) for k in PASSED_OVER_HTTP & kwargs.keys()) or _headers_matter(kwargs):
        return None
    body = {k: v for k, v in kwargs.items() if k not in REQUEST_OPTIONS and not _omitted(v)}
    extra = kwargs.get("extra_body")
    if extra is not None:
        if not isinstance(extra, dict):
            return None
        body.update(extra)
    try:  # as the package sends it (its JSON settings), with models and iterables as its transform leaves them
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=_plain)
    except (TypeError, ValueError, RecursionError):
        return None  # (the package raises its own error for it, or sends what this cannot)
    task = asyncio.ensure_future(gateway.answer(route, f"Bearer {client.api_key}", data))
    # The call is the gateway's once made, as over HTTP: a program cancelled meanwhile does not cancel it.
    task.add_done_callback(_retrieve)
    try:
        response = await asyncio.wait_for(asyncio.shield(task), _seconds(client.timeout))
    except TimeoutError:
        raise APITimeoutError(request=_request(client, route)) from None
    except GatewayError as e:
        raise _status_error(client, route, e) from None
    return response  # (built for this call alone: the package's models made of it share nothing with the gateway)


def _model(cls: type[BaseModel], response: dict[str, Any]) -> Any:
    """The response as the package's model: validated (pydantic's core, a few microseconds), or built as
    the package builds it (`construct`, no validation: a tenth of a millisecond) if it does not validate."""
    try:
        return cls.model_validate(response)
    except ValidationError:
        return cls.construct(**response)


def _omitted(value: Any) -> bool:
    return isinstance(value, (Omit, NotGiven))


def _given(value: Any) -> bool:
    """Whether an argument of `PASSED_OVER_HTTP` asks for something (a timeout of 0 does: `0 == False`)."""
    return value is not None and value is not False and not _omitted(value)


def _headers_matter(kwargs: dict[str, Any]) -> bool:
    """Whether a call's `extra_headers` could change how it is answered: the gateway reads the `Authorization`
    header alone (the key), and the package reads its own `X-Stainless-*` ones (`with_raw_response` and
    `with_streaming_response` ask for the raw HTTP response so); a call with either goes over HTTP."""
    headers = kwargs.get("extra_headers")
    if headers is None or _omitted(headers):
        return False
    if not isinstance(headers, dict):
        return True
    return any(str(name).lower() == "authorization" or str(name).lower().startswith("x-stainless") for name in headers)


def _plain(value: Any) -> Any:
    """What the package's request transform makes of a value that JSON cannot hold as it is."""
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_unset=True, mode="json", exclude=getattr(value, "__api_exclude__", None))
    if isinstance(value, (str, bytes, bytearray)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{type(value).__name__} is not sent in-process")
    return dict(value) if hasattr(value, "keys") else list(value)


def _seconds(timeout: Any) -> float | None:
    """The client's timeout as one bound on the reply (httpx's read timeout when it is a Timeout)."""
    if isinstance(timeout, (int, float)):
        return float(timeout)
    return getattr(timeout, "read", None)


def _request(client: Any, route: str) -> httpx.Request:
    return httpx.Request("POST", f"{str(client.base_url).rstrip('/')}{ROUTES[route]}")


def _status_error(client: Any, route: str, error: GatewayError) -> Exception:
    """The exception the package raises for `error`'s HTTP reply: its class, message, status and body."""
    body = error.body()
    response = httpx.Response(error.status, json=body, request=_request(client, route))
    return client._make_status_error(f"Error code: {error.status} - {error.message}", body=body, response=response)


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # (read, so an abandoned call's error is not reported as never retrieved)
