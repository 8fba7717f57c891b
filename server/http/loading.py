"""A streamed request for a model that is not loaded: the stream starts at once and
sends its dialect's keepalive while the model loads (a big model's load can take
longer than a client's idle timer), then carries the real stream.

Non-streamed requests, and requests for a loaded model, answer as before: the
route waits for the model (`deps.serving`). Once the stream has started, a
load that fails, or a request the loaded model refuses (its context, say),
arrives as the dialect's in-stream error event: the status can no longer change.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from sse_starlette import ServerSentEvent

from flashserve.engine.generation.worker import Engine
from flashserve.engine.models.pool import ModelPool, ModelUnavailableError, UnknownModelError
from flashserve.engine.weights.model import LoadedModel
from flashserve.server.http.deps import serving
from flashserve.server.http.errors import APIError, model_not_found, model_unavailable
from flashserve.server.http.sse import EventStream
from flashserve.server.settings import Settings

Dialect = Literal["chat", "completion", "messages", "responses"]
Make = Callable[[Engine, LoadedModel], Awaitable[Any]]


async def answer(
    request: Request, name: str | None, stream: bool, dialect: Dialect, make: Make
) -> Any:
    """`make(engine, loaded)`'s response for the model `name`; a stream for a model that
    must load first starts at once and keeps the client's idle timer alive."""
    pool: ModelPool = request.app.state.pool
    settings: Settings = request.app.state.settings
    try:
        slot = pool.resolve(name)
    except UnknownModelError:
        raise model_not_found(name or "") from None
    if not stream or slot.engine is not None or settings.stream_keepalive <= 0:
        async with serving(request, name) as (engine, loaded):
            return await make(engine, loaded)
    return EventStream(_load_then_stream(request, name, slot.entry.name, dialect, make))


async def _load_then_stream(
    request: Request, name: str | None, model: str, dialect: Dialect, make: Make
) -> AsyncIterator[Any]:
    pool: ModelPool = request.app.state.pool
    settings: Settings = request.app.state.settings
    path = request.url.path

    async def load() -> None:
        async with pool.lease(name, timeout=settings.request_timeout):
            pass

    task = asyncio.ensure_future(load())
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=settings.stream_keepalive)
            if not done:
                yield _keepalive(dialect, model)
        task.result()
        async with serving(request, name) as (engine, loaded):
            response = await make(engine, loaded)
    except ModelUnavailableError as exc:
        yield _error(dialect, model_unavailable(str(exc), exc.transient), path)
        return
    except APIError as exc:
        yield _error(dialect, exc, path)
        return
    finally:
        task.cancel()
    if not isinstance(response, EventStream):  # the route answered whole: pass its body on
        body = response.body if isinstance(response, Response) else b""
        yield body.decode() if isinstance(body, bytes) else str(body)
        return
    inner = response.body_iterator
    try:
        async for item in inner:
            yield item
    finally:
        await inner.aclose()  # type: ignore[attr-defined]


def _keepalive(dialect: Dialect, model: str) -> Any:
    """The dialect's own keepalive, the same the generation streams send."""
    if dialect == "messages":
        return {"event": "ping", "data": json.dumps({"type": "ping"})}
    if dialect == "responses":  # its events need the response object: a comment
        return ServerSentEvent(comment=f"loading {model}")
    created = int(time.time())
    if dialect == "chat":
        return json.dumps(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": {}, "finish_reason": None}],
            }
        )
    return json.dumps(
        {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}],
        }
    )


def _error(dialect: Dialect, exc: APIError, path: str) -> Any:
    if dialect == "responses":  # its `error` event, as a failure after the stream began
        detail = exc.detail
        event = {"type": "error", "code": detail.code or detail.type, "message": detail.message}
        event |= {"param": detail.param, "sequence_number": 0}
        return {"event": "error", "data": json.dumps(event)}
    if dialect == "messages":
        return {"event": "error", "data": exc.body_json(path)}
    return exc.body_json(path)
