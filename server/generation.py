"""The server's client of the engine: submit a generation, read it as text, cancel it.

Shared by every endpoint that generates: the context budget (max_tokens
against the model's context length, checked before any generation),
submitting to the engine, reading the events as text pieces, cancelling when
the client goes away, and the SSE wrapper of a streamed response.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request

from flashserve.engine.generation.requests import (
    DoneEvent,
    ErrorEvent,
    GenerationRequest,
    PromptLogprobsEvent,
    RequestHandle,
    TokenEvent,
)
from flashserve.engine.generation.worker import Engine
from flashserve.server.http.errors import SERVER_ERROR, APIError, invalid_request
from flashserve.server.http.lifecycle import RequestTracker

log = logging.getLogger(__name__)

T = TypeVar("T")


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def completion_budget(
    prompt_tokens: int,
    requested: int | None,
    context_length: int,
    default_max_tokens: int | None,
    prompt_param: str,
    max_tokens_param: str = "max_tokens",
    clamp: bool = False,
) -> int:
    """max_tokens for the engine; 400 when prompt + completion cannot fit the context.

    An explicit max_tokens must fit whole, unless `clamp` (the dialect reads it
    as an upper bound: then it is cut to what the context has left). Without
    one, the answer may take what the context has left, as OpenAI's APIs and
    llama.cpp's server do: agents (Codex sends `max_output_tokens: null`) fail
    a turn cut at a fixed default. `default_max_tokens`, when the server sets
    one, caps it.
    """
    if requested is not None and not clamp:
        if prompt_tokens + requested > context_length:
            raise invalid_request(
                f"This model's maximum context length is {context_length} tokens. However, you "
                f"requested {prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, "
                f"{requested} in the completion). Reduce the length of the prompt or "
                f"{max_tokens_param}.",
                max_tokens_param,
                "context_length_exceeded",
            )
        return requested
    remaining = context_length - prompt_tokens
    if remaining < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {context_length} tokens. However, the "
            f"prompt is {prompt_tokens} tokens, which leaves no room for a completion. Reduce "
            f"the length of the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
            # Claude Code compacts the conversation only on Anthropic's own words.
            anthropic_message=f"prompt is too long: {prompt_tokens} tokens > "
            f"{context_length - 1} maximum",
        )
    cap = default_max_tokens if requested is None else requested
    return remaining if cap is None else min(cap, remaining)


@dataclass
class Piece:
    """New text of one choice, with the tokens whose logprobs go with it: those that
    produced it, and those whose text was held back (an incomplete character, a
    possible stop string) since the last piece. A choice's last piece has `done`."""

    index: int  # the choice
    text: str
    tokens: list[TokenEvent] = field(default_factory=list)  # only when logprobs were asked
    done: DoneEvent | None = None
    prompt: PromptLogprobsEvent | None = None  # a piece of its own, before any text


class Generation:
    """One submitted generation, read as text pieces; `outcome` is set at the end
    (`outcomes` per choice; `outcome` is the last choice's to end)."""

    def __init__(self, handle: RequestHandle):
        self.handle = handle
        self.outcome: DoneEvent | None = None
        self.outcomes: dict[int, DoneEvent] = {}

    @property
    def request_id(self) -> str:
        return self.handle.request.request_id

    async def pieces(self) -> AsyncIterator[str]:
        """Generated text as it comes (stop strings already cut by the engine), for a
        request of one choice. Raises APIError when the generation fails or is cancelled.
        """
        async for piece in self.choice_pieces():
            if piece.text:
                yield piece.text

    async def choice_pieces(self) -> AsyncIterator[Piece]:
        """Every choice's pieces as they come (choices interleave), each choice's last
        with `done`. Raises APIError when the generation fails or is cancelled."""
        held: dict[int, list[TokenEvent]] = {}
        async for event in self.handle:
            if isinstance(event, TokenEvent):
                tokens = held.setdefault(event.index, [])
                if event.logprob is not None:
                    tokens.append(event)
                if event.text:
                    yield Piece(event.index, event.text, tokens[:])
                    tokens.clear()
            elif isinstance(event, PromptLogprobsEvent):
                yield Piece(0, "", prompt=event)
            elif isinstance(event, DoneEvent):
                if event.finish_reason == "cancelled":
                    raise APIError(
                        503, "The generation was cancelled.", type=SERVER_ERROR, code="cancelled"
                    )
                self.outcome = self.outcomes[event.index] = event
                yield Piece(event.index, event.text, held.pop(event.index, []), done=event)
            elif isinstance(event, ErrorEvent):
                raise APIError(
                    event.status,
                    event.message,
                    type=event.type,
                    code=event.code,
                    param=event.param,
                )

    def cancel(self) -> None:
        self.handle.cancel()


def submit(
    engine: Engine, request: GenerationRequest, tracker: RequestTracker | None = None
) -> Generation:
    """Queue a generation (QueueFullError -> 429 and EngineNotReadyError -> 503 by the
    app's error handlers). Every route submits through here. The tracker
    (app.state.tracker) applies the time limit and the shutdown drain."""
    handle = engine.submit(request)
    return Generation(tracker.track(handle) if tracker is not None else handle)


@asynccontextmanager
async def cancel_on_disconnect(request: Request, generation: Generation) -> AsyncIterator[None]:
    """For a non-streaming response: cancel the generation if the client disconnects
    while it runs, and whenever the handler stops waiting for it."""

    async def watch() -> None:
        # The body is already read, so the next ASGI message is the disconnect.
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                log.info("client disconnected; cancelling %s", generation.request_id)
                generation.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        generation.cancel()  # no-op after a normal finish; stops the worker otherwise


async def with_keepalive(source: AsyncIterator[T], interval: float) -> AsyncIterator[T | None]:
    """`source`'s items, and None whenever `interval` seconds pass without one.

    A dialect's stream turns each None into its own keepalive event. A long
    prefill sends nothing for minutes, and clients' idle timers (Codex's
    stream_idle_timeout_ms, proxies) count only events: SSE comments, which
    sse-starlette sends, do not reset them. `interval` <= 0: no Nones.
    """
    if interval <= 0:
        async for item in source:
            yield item
        return
    items = aiter(source)
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        close = getattr(items, "aclose", None)
        if close is not None:
            await close()


async def sse_events(
    generation: Generation, chunks: AsyncIterator[str], done: bool = True
) -> AsyncIterator[str]:
    """SSE data lines of one streamed response: its chunks, then `[DONE]` (unless not
    `done`: llama.cpp's /infill ends with its last chunk).

    A failure after the headers went out becomes an error object in the stream
    (the status can no longer change). sse-starlette cancels this generator
    when the client disconnects, and the finally block then cancels the
    generation.
    """
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:
        yield exc.body_json()
    except Exception as exc:  # a bug: tell the client, keep serving
        log.exception("stream %s failed", generation.request_id)
        yield APIError(500, f"{type(exc).__name__}: {exc}", type=SERVER_ERROR).body_json()
    finally:
        generation.cancel()
    if done:
        yield "[DONE]"
