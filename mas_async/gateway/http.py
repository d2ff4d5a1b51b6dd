"""The gateway's aiohttp runner: a request that aiohttp's HTTP parser refuses is answered in OpenAI's shape.

aiohttp answers a request it cannot parse (a header line over its 8190-byte limit, a malformed request
line or header) itself, before any handler or middleware runs, with a plain-text 400 whose body and log
line quote the start of the offending line. For an oversized `Authorization` header that start is the
run's token (`access.py`). `Runner` serves the same app, but such a request gets an OpenAI error object
(`{"error": {...}}`, the status aiohttp chose, code "malformed_request") that names the kind of problem
and quotes nothing, and the log line names the peer and the kind, without the parser's message.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from mas_async.gateway.errors import GatewayError

__all__ = ["Runner"]

log = logging.getLogger("mas_async.gateway")


class _Handler(web.RequestHandler):
    """aiohttp's connection handler, but for the parser's errors (module docstring)."""

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        kind = type(exc).__name__
        log.warning("gateway: refused a request from %s that HTTP cannot parse (%s)", request.remote, kind)
        error = GatewayError(
            status,
            f"the request is not valid HTTP ({kind}: a header line over 8190 bytes, or a malformed line)",
            code="malformed_request",
        )
        response = web.Response(status=status, text=json.dumps(error.body()), content_type="application/json")
        response.force_close()
        return response


class _Server(web.Server):
    def __call__(self) -> web.RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """`web.AppRunner` whose connections are handled by `_Handler`."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # (the app builds its own Server; only how it makes handlers changes)
        return server
