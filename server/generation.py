"""From validated request fields to a running generation, and from its events to text.

Shared by the chat and completions routes: sampling parameters, the context
budget (max_tokens against the model's context length, checked before any
generation), submitting to the engine, reading the events as text pieces, and
cancelling when the client goes away.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Request

from engine.requests import (
    DoneEvent,
    ErrorEvent,
    GenerationRequest,
    RequestHandle,
    SamplingParams,
    TokenEvent,
)
from engine.worker import Engine

from .errors import SERVER_ERROR, APIError, invalid_request
from .lifecycle import RequestTracker
from .schemas import SamplingFields, Usage

log = logging.getLogger(__name__)

DEFAULT_TEMPERATURE = 1.0  # the OpenAI API's default


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def sampling_params(body: SamplingFields, vocab_size: int) -> SamplingParams:
    bias: dict[int, float] | None = None
    if body.logit_bias:
        bias = {}
        for key, value in body.logit_bias.items():
            token = int(key)
            if not 0 <= token < vocab_size:
                raise invalid_request(
                    f"logit_bias names token id {token}, outside the vocabulary "
                    f"(0..{vocab_size - 1}).",
                    "logit_bias",
                    "invalid_value",
                )
            bias[token] = float(value)
    return SamplingParams(
        temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        # top_k at or above the vocabulary size keeps every token: the same as off.
        top_k=body.top_k if body.top_k and 0 < body.top_k < vocab_size else 0,
        min_p=body.min_p or 0.0,
        # OpenAI seeds are signed 64-bit; MLX keys take unsigned ones.
        seed=None if body.seed is None else body.seed % 2**64,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        logit_bias=bias,
    )


def completion_budget(
    prompt_tokens: int,
    requested: int | None,
    context_length: int,
    default_max_tokens: int,
    prompt_param: str,
    max_tokens_param: str = "max_tokens",
) -> int:
    """max_tokens for the engine; 400 when prompt + completion cannot fit the context.

    An explicit max_tokens must fit whole; without one, the default is capped to
    what the context has left.
    """
    if requested is not None:
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
        raise invalid_request(
            f"This model's maximum context length is {context_length} tokens. However, the "
            f"prompt is {prompt_tokens} tokens, which leaves no room for a completion. Reduce "
            f"the length of the prompt.",
            prompt_param,
            "context_length_exceeded",
        )
    return min(default_max_tokens, remaining)


class Generation:
    """One submitted generation, read as text pieces; `outcome` is set at the end."""

    def __init__(self, handle: RequestHandle):
        self.handle = handle
        self.outcome: DoneEvent | None = None

    @property
    def request_id(self) -> str:
        return self.handle.request.request_id

    async def pieces(self) -> AsyncIterator[str]:
        """Generated text as it comes (stop strings already cut by the engine).

        Raises APIError when the generation fails or is cancelled.
        """
        async for event in self.handle:
            if isinstance(event, TokenEvent):
                if event.text:
                    yield event.text
            elif isinstance(event, DoneEvent):
                if event.text:
                    yield event.text
                if event.finish_reason == "cancelled":
                    raise APIError(
                        503, "The generation was cancelled.", type=SERVER_ERROR, code="cancelled"
                    )
                self.outcome = event
            elif isinstance(event, ErrorEvent):
                raise APIError(500, event.message, type=event.type, code=event.code)

    def usage(self) -> Usage:
        assert self.outcome is not None
        prompt, completion = self.outcome.prompt_tokens, self.outcome.completion_tokens
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
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


async def sse_events(generation: Generation, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """SSE data lines of one streamed response: its chunks, then `[DONE]`.

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
    yield "[DONE]"
