"""What the server hands the engine, and what comes back.

The server talks to the engine only through these types and `Engine`
(engine/generation/worker.py): submit a GenerationRequest, iterate its events, cancel,
read stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

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
    # The output continues the prompt's text (completions, fill-in-the-middle), so
    # its first space is text; after a chat turn's header it is the tokenizer's.
    continuation: bool = False
    n: int = 1  # choices: decoded together in the batch after one shared prefill
    # None: no logprobs. k >= 0: each TokenEvent carries the sampled token's logprob
    # and the k most likely tokens' (generation/logprobs.py says which distribution).
    logprobs: int | None = None
    # None: none. k >= 0: one PromptLogprobsEvent before the first token. Every
    # position must be computed, so such a request does not read the prompt cache.
    prompt_logprobs: int | None = None
    # Fresh processors for choice i (called once per choice); without it every
    # choice shares `logits_processors`, which is right only when they hold no state.
    processor_factory: Callable[[int], list[LogitsProcessor]] | None = None
    # False: no speculative decoding for this request, whatever the server's setting.
    speculative: bool = True
    # A vision-language model's images (vision.images.Image), in prompt order; their
    # placeholders in prompt_tokens are marked (vision/prompt.py).
    images: list[Any] = field(default_factory=list)


@dataclass
class TokenEvent:
    token: int
    text: str  # new text since the previous event (may be "" while held back)
    index: int = 0  # the choice
    logprob: float | None = None  # when the request asked for logprobs
    # (token id, logprob), most likely first; tokens a constraint forbids are left out.
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class PromptLogprobsEvent:
    """The prompt's tokens and their logprobs (the first has none: nothing precedes it)."""

    tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


@dataclass
class DoneEvent:
    finish_reason: str  # stop | length | cancelled
    prompt_tokens: int
    completion_tokens: int
    text: str = ""  # text released at the end (held back for stop matching)
    cached_tokens: int = 0  # prompt tokens restored from the prompt cache, not prefilled
    stop_sequence: str | None = None  # the request's stop string that ended it, if one did
    index: int = 0  # the choice that ended (prompt_tokens and cached_tokens are the request's)


@dataclass
class ErrorEvent:
    message: str
    type: str = "server_error"
    code: str | None = None
    status: int = 500  # 400 when the request itself could not be served as asked
    param: str | None = None


class InvalidRequest(ValueError):
    """A request the engine cannot serve as asked: its error is a 400 naming `param`."""

    status = 400
    code: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


Event = TokenEvent | DoneEvent | ErrorEvent | PromptLogprobsEvent


def error_event(exc: BaseException | None) -> ErrorEvent:
    """The event that ends a request that failed with `exc`. An exception that
    blames the request carries `status` (4xx), `code` and `param` (GrammarError
    does); any other failure is the server's (500)."""
    status = getattr(exc, "status", 500)
    if isinstance(status, int) and 400 <= status < 500:
        return ErrorEvent(
            str(exc),
            type="invalid_request_error",
            code=getattr(exc, "code", None),
            status=status,
            param=getattr(exc, "param", None),
        )
    return ErrorEvent(f"generation failed: {exc}")


class RequestHandle:
    """One submitted request: an async stream of events plus cancel().

    Created on the event loop; the worker thread pushes events with
    loop.call_soon_threadsafe so that the loop never blocks on MLX.
    """

    def __init__(
        self,
        request: GenerationRequest,
        loop: asyncio.AbstractEventLoop,
        on_release: Callable[[], None] | None = None,
    ):
        """`on_release`: called once, when the request stops holding an admission
        slot (it ended, or it was cancelled while still waiting in the queue)."""
        self.request = request
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = False  # read by the worker between tokens
        self.started = False  # set by the worker when it takes the request
        # Time to first token in parts (perf_counter): submitted here, taken by the worker.
        self.submitted_at = time.perf_counter()
        self.taken_at: float | None = None
        # Its images encoded (vision/embed.py ImageEncodes took it back): a TTFT part.
        self.encoded_at: float | None = None
        # Prompt tokens the prompt cache gave, once the worker has looked the prompt
        # up (None before): a dialect that reports usage up front waits for it.
        self.cached_tokens: int | None = None
        self._admitted = asyncio.Event()
        self._admit_sent = False  # worker side: whether _admitted is on its way
        self._on_release = on_release
        self._release_lock = threading.Lock()
        # Choices still running, counted by the worker thread (a request ends with
        # its last choice's DoneEvent, or its first ErrorEvent).
        self._open_choices = request.n

    def release(self) -> None:
        """Give the admission slot back (idempotent)."""
        with self._release_lock:
            callback, self._on_release = self._on_release, None
        if callback is not None:
            callback()

    def was_cancelled(self) -> bool:
        """Whether the client went away (what a long prefill checks as it goes)."""
        return self.cancelled

    def cancel(self) -> None:
        self.cancelled = True
        if not self.started:
            # A waiting request frees its slot now, not when the worker reaches it.
            self.release()

    def admit(self, cached_tokens: int) -> None:
        """Called from the worker thread once the prompt is looked up in the prompt cache."""
        self._admit_sent = True
        self._call_soon(self._set_admitted, cached_tokens)

    def _set_admitted(self, cached_tokens: int | None) -> None:
        if self.cached_tokens is None:
            self.cached_tokens = cached_tokens
        self._admitted.set()

    async def wait_admitted(self, timeout: float | None) -> int | None:
        """The prompt tokens the prompt cache gave, or None when the worker has not
        looked the prompt up within `timeout` seconds (None: no limit), or the
        request ended first."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._admitted.wait(), timeout)
        return self.cached_tokens

    def _call_soon(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            # The loop is closed (server shutting down): nobody is listening.
            self.cancelled = True

    def push(self, event: Event) -> None:
        """Called from the worker thread."""
        if isinstance(event, DoneEvent):
            self._open_choices -= 1
        if isinstance(event, ErrorEvent) or (
            isinstance(event, DoneEvent) and self._open_choices <= 0
        ):
            self.release()
        self._call_soon(self._queue.put_nowait, event)
        if not self._admit_sent:  # a request that ended unadmitted: nobody waits on
            self._admit_sent = True
            self._call_soon(self._set_admitted, None)

    async def events(self) -> AsyncIterator[Event]:
        open_choices = self.request.n
        while True:
            event = await self._queue.get()
            yield event
            if isinstance(event, DoneEvent):
                open_choices -= 1
            if isinstance(event, ErrorEvent) or open_choices <= 0:
                return

    def __aiter__(self) -> AsyncIterator[Event]:
        return self.events()
