"""Server-sent events: a finished response sent as OpenAI's stream of chunks (`stream: true`).

The inference servers return whole completions (they do not stream tokens), so a streamed call is sampled,
cut at its stop strings, parsed for tool calls and recorded exactly as a non-streamed one, and only then
sent as chunks: a client gets the same choices, just later than a token-streaming server would send the
first of them. Everything the call can fail on (the request's fields, the episode, the inference server)
is therefore known before the first byte, and answered with the usual OpenAI error JSON.

The events are `data: <chunk JSON>\\n\\n` lines, then `data: [DONE]\\n\\n`. Per choice (in index order):
the chunks that `responses.py` builds from it (a role delta, content deltas token by token, each with its
log-prob entry, `top_logprobs` included, when asked, tool calls), then a last chunk with its
`finish_reason` that also carries the choice's `token_ids`, `prompt_token_ids` and `weight_version` and
the chunk's top-level `mas_async` object. With
`stream_options.include_usage` every chunk has `"usage": null` and a last chunk has no choices and the
usage. The events are written in one bounded write (`SEND_TIMEOUT_S`); a client that goes away or stops
reading only loses its stream, and the call stays recorded, as it would if it dropped a non-streamed reply.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web

log = logging.getLogger("mas_async.gateway")

SEND_TIMEOUT_S = 30.0
EXTRAS = ("token_ids", "prompt_token_ids", "weight_version")
"""The gateway's fields of a choice, carried on the last chunk of that choice."""


def chunks(
    response: dict[str, Any],
    kind: str,
    deltas: Callable[[dict[str, Any]], Iterable[dict[str, Any]]],
    empty: dict[str, Any],
    usage: bool,
) -> list[dict[str, Any]]:
    """The chunks of `response`: for each choice, `deltas(choice)` (chunk choices without a finish reason),
    then its last chunk (`empty` delta, finish reason, extras); then the usage chunk when `usage`."""
    head = {"id": response["id"], "object": kind, "created": response["created"], "model": response["model"]}
    if usage:
        head["usage"] = None
    out = []
    for choice in response["choices"]:
        out.extend({**head, "choices": [delta]} for delta in deltas(choice))
        last = {"index": choice["index"], **empty, "logprobs": None, "finish_reason": choice["finish_reason"]}
        last.update((k, choice[k]) for k in EXTRAS)
        out.append({**head, "choices": [last], "mas_async": response["mas_async"]})
    if usage:
        out.append({**head, "choices": [], "usage": response["usage"]})
    return out


def pieces(tokenizer: Any, ids: list[int], text: str) -> list[str]:
    """`text` split token by token: pieces[i] is what token i adds ("" for a special token, or for a token
    whose characters complete with a later one) and "".join(pieces) == text, also when `text` was cut at a
    stop string. Incremental detokenisation over a short window (as TGI and vLLM do it), O(len(ids))."""
    out, done = [], 0
    prefix_offset = read_offset = 0
    for i in range(len(ids)):
        seen = tokenizer.decode(ids[prefix_offset:read_offset], skip_special_tokens=True)
        now = tokenizer.decode(ids[prefix_offset : i + 1], skip_special_tokens=True)
        delta = ""
        if len(now) > len(seen) and not now.endswith("\ufffd"):
            delta = now[len(seen) :]
            prefix_offset, read_offset = read_offset, i + 1
        piece = delta if text.startswith(delta, done) else text[done:]  # the text was cut inside this delta
        out.append(piece)
        done += len(piece)
    if done < len(text):  # text the ids do not decode to piece by piece: it comes with the last token
        out = [*out[:-1], (out[-1] if out else "") + text[done:]]
    return out


async def send(request: web.Request, events: list[dict[str, Any]]) -> web.StreamResponse:
    """Write `events` as server-sent events and `[DONE]`, bounded by SEND_TIMEOUT_S."""
    body = b"".join(b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n" for e in events)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        await asyncio.wait_for(response.write(body + b"data: [DONE]\n\n"), SEND_TIMEOUT_S)
        await asyncio.wait_for(response.write_eof(), SEND_TIMEOUT_S)
    except (ConnectionError, asyncio.TimeoutError) as e:  # the client went away or stopped reading
        log.info("gateway: a stream to %s was not delivered: %s", request.remote, type(e).__name__)
        if request.transport is not None:
            request.transport.close()
    return response
