"""A request on its way into the batch, and each of its choices once there.

A request with n choices becomes n sequences of the batch. Each keeps its own
text state (detokenizer, stop strings), sampler and processors, and reports
its tokens, logprobs and end under its own index.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from flashserve.engine.generation.logprobs import sampled_logprobs
from flashserve.engine.generation.prefill.alone import PromptScores
from flashserve.engine.generation.requests import DoneEvent, RequestHandle, TokenEvent
from flashserve.engine.generation.sampling import GuardedProcessors
from flashserve.engine.generation.stats import TtftParts
from flashserve.engine.generation.stops import StopMatcher


@dataclass
class Start:
    """A request on its way into the batch."""

    handle: RequestHandle
    prompt: list[int]
    cache: list[Any] | None  # the state after prompt[:reused]
    reused: int  # tokens the cache covers
    processors: GuardedProcessors | None  # choice 0's
    failed: bool = False
    logits: Any = None  # once prefilled outside the batch: the first token's (vocab,) logits
    scores: PromptScores | None = None  # the prompt's logprobs, when asked for
    started: float = field(default_factory=time.perf_counter)  # prompt looked up
    prefilled_at: float | None = None  # prefilled outside the batch: when
    encoded: Any = None  # its images' features, encoded ahead (vision/embed.py ImageEncodes)

    def __post_init__(self) -> None:
        self.cached = self.reused  # tokens the prompt cache gave: reported as cached_tokens

    @property
    def alone(self) -> bool:
        """Whether the prompt is prefilled outside the batch (prefill/alone.py says why)."""
        request = self.handle.request
        return (
            request.n > 1
            or request.prompt_logprobs is not None
            or request.max_tokens == 0
            or bool(self.images)  # prefilled with the images' embeddings (vision/embed.py)
        )

    @property
    def images(self) -> list[Any]:
        return self.handle.request.images


@dataclass
class Choice:
    """One sequence in the batch: a request's choice `index` and its text state."""

    uid: int
    handle: RequestHandle
    index: int
    detokenizer: Any
    stops: StopMatcher
    processors: GuardedProcessors | None
    started: float
    cached_tokens: int = 0  # prompt tokens restored from the prompt cache
    prefilled_at: float | None = None  # the prompt's prefill ended (its logits ready)
    first_token_at: float | None = None
    generated: int = 0
    failed: BaseException | None = None
    prompt_end_pending: bool = False  # prompt[:-1]'s state is stored after the first token

    def emit(self, token: int, logprobs: mx.array | None) -> None:
        """Send `token` (its text once the detokenizer and stop strings release it)."""
        if self.generated == 0:
            self.first_token_at = time.perf_counter()
        self.generated += 1
        self.detokenizer.add_token(token)
        text = self.stops.feed(self.detokenizer.last_segment)
        event = TokenEvent(token, text, index=self.index)
        k = self.handle.request.logprobs
        if k is not None and logprobs is not None:
            event.logprob, event.top_logprobs = sampled_logprobs(logprobs, token, k)
        self.handle.push(event)

    def ttft_parts(self) -> TtftParts | None:
        """Where the time to this choice's first token went (None without one)."""
        handle = self.handle
        if self.first_token_at is None or handle.taken_at is None:
            return None
        prefilled = self.prefilled_at or self.first_token_at
        encoded = handle.encoded_at or self.started
        return TtftParts(
            queue_wait_s=handle.taken_at - handle.submitted_at,
            cache_lookup_s=self.started - handle.taken_at,
            image_encode_s=encoded - self.started,
            prefill_s=prefilled - encoded,
            first_step_s=self.first_token_at - prefilled,
        )

    def done(self, reason: str) -> DoneEvent:
        """The choice's last event. Text held back for stop matching is the client's,
        even on a cut."""
        self.detokenizer.finalize()
        tail = self.stops.feed(self.detokenizer.last_segment) + self.stops.flush()
        return DoneEvent(
            reason,
            len(self.handle.request.prompt_tokens),
            self.generated,
            text=tail,
            cached_tokens=self.cached_tokens,
            stop_sequence=self.stops.matched,
            index=self.index,
        )


def detokenizer_for(tokenizer: Any, continuation: bool) -> Any:
    """A choice's streaming detokenizer: mlx-lm's, its first space kept for a
    continuation (keep_first_space), and a lone space sent with its own token."""
    detokenizer = tokenizer.detokenizer
    if type(detokenizer) is BPEStreamingDetokenizer:
        detokenizer.__class__ = SpacesAtOnce
    return keep_first_space(detokenizer) if continuation else detokenizer


class SpacesAtOnce(BPEStreamingDetokenizer):
    """mlx-lm's BPE detokenizer, with a token that is one space released at once.

    mlx-lm holds such a token until the next one, so that an answer's first space can
    still be dropped (its _maybe_trim_space), and it drops spaces only while its text
    is empty. Once the text has begun the hold changes nothing in the text, only when
    the space goes out: one decode step later, and for a request's first token two
    (its successor runs lazily, fairness.first_token_gate): ~18 ms on the default
    model added to the first chunk of every completion that starts with a space. So
    it is held only while the text is empty (a chat answer's first space)."""

    def add_token(self, token: int) -> None:
        super().add_token(token)
        if self._unflushed and self.text:
            text = self._decode_bytes(self._unflushed)
            if not text.endswith("\ufffd"):  # a multi-byte character still waits
                self.text += text
                self._unflushed = ""


def keep_first_space(detokenizer: Any) -> Any:
    """mlx-lm's BPE and SentencePiece streaming detokenizers drop the first space of
    their text: right for an answer after a chat header ("▁Hello" is "Hello"),
    wrong for a continuation ("The capital of France is" + " Paris"). They drop
    it only while their text is empty, so a seed character, never sent (the
    offset starts past it), keeps it."""
    if isinstance(detokenizer, (BPEStreamingDetokenizer, SPMStreamingDetokenizer)):
        detokenizer.text = "\u2060"
        detokenizer.offset = len(detokenizer.text)
    return detokenizer
