"""What the server hands the engine, and what comes back.

The server talks to the engine only through these types and `Engine`
(engine/generation/worker.py): submit a GenerationRequest, iterate its events, cancel,
read stats.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import mlx.core as mx

# (tokens generated so far incl. prompt, logits[1, vocab]) -> logits
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

_ids = itertools.count()


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None


@dataclass
class GenerationRequest:
    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)  # matched on text, never emitted
    # Extra processors built by the server (constrained decoding, tool_choice);
    # fresh objects per request, since they may hold state.
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    # Start from the longest cached prefix and store this prompt's state
    # (when the engine has a prompt cache).
    use_prompt_cache: bool = True


@dataclass
class TokenEvent:
    token: int
    text: str  # new text since the previous event (may be "" while held back)


@dataclass
class DoneEvent:
    finish_reason: str  # stop | length | cancelled
    prompt_tokens: int
    completion_tokens: int
    text: str = ""  # text released at the end (held back for stop matching)
    cached_tokens: int = 0  # prompt tokens restored from the prompt cache, not prefilled


@dataclass
class ErrorEvent:
    message: str
    type: str = "server_error"
    code: str | None = None


Event = TokenEvent | DoneEvent | ErrorEvent


class RequestHandle:
    """One submitted request: an async stream of events plus cancel().

    Created on the event loop; the worker thread pushes events with
    loop.call_soon_threadsafe so that the loop never blocks on MLX.
    """

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = False  # read by the worker between tokens

    def cancel(self) -> None:
        self.cancelled = True

    def push(self, event: Event) -> None:
        """Called from the worker thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:
            # The loop is closed (server shutting down): nobody is listening.
            self.cancelled = True

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self._queue.get()
            yield event
            if not isinstance(event, TokenEvent):
                return

    def __aiter__(self) -> AsyncIterator[Event]:
        return self.events()
