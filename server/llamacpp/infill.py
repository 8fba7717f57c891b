"""POST /infill in llama.cpp's dialect: fill the code between a prefix and a suffix.

The prompt is arranged as llama.cpp arranges it (server/fim.py): other files
(`input_extra`) first, then `<prefix>` input_prefix prompt `<suffix>`
input_suffix `<middle>`, on token ids. The fill ends at the model's FIM end
tokens, at a stop word, or at n_predict. The answer is llama.cpp's /completion
object; streamed, `data: {"content": ..., "stop": false}` chunks and a last one
with `"stop": true` and the totals, without a `[DONE]` (llama-server sends one
only on its OpenAI-compatible routes).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from flashserve.engine.generation.requests import (
    DoneEvent,
    GenerationRequest,
    LogitsProcessor,
    SamplingParams,
)
from flashserve.engine.generation.worker import Engine
from flashserve.engine.weights.model import LoadedModel
from flashserve.server.chat.conversation import PromptLimits
from flashserve.server.chat.prompts import run_render_job
from flashserve.server.fim import FimTokens, arrange, encode_text, repo_context, require_fim
from flashserve.server.generation import (
    Generation,
    cancel_on_disconnect,
    completion_budget,
    new_id,
    sse_events,
    submit,
)
from flashserve.server.http.sse import EventStream
from flashserve.server.llamacpp.protocol import (
    DEFAULT_MIN_P,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    InfillChunk,
    InfillRequest,
    InfillResponse,
    InfillTimings,
)
from flashserve.server.openai.common import GREEDY_BELOW


@dataclass(frozen=True)
class InfillOptions:
    """What the route reads from the settings and the loaded model."""

    default_max_tokens: int | None
    vocab_size: int
    limits: PromptLimits = field(default_factory=PromptLimits)


async def create_infill(
    body: InfillRequest,
    request: Request,
    loaded: LoadedModel,
    engine: Engine,
    options: InfillOptions,
    extra_processors: list[LogitsProcessor] | None = None,
) -> InfillResponse | EventStream:
    # Encoding is CPU work: on a render thread, within template_timeout (chat/prompts.py).
    # Room for the prompt: the context less what the fill may take (at most a quarter).
    wanted = body.n_predict if body.n_predict > 0 else options.default_max_tokens
    wanted = wanted or loaded.context_length  # no limit: the fill's quarter below
    room = loaded.context_length - max(1, min(wanted, loaded.context_length // 4))
    prompt, fim, truncated = await run_render_job(
        lambda deadline: infill_prompt(loaded.tokenizer, body, room),
        options.limits,
        "input_prefix",
    )
    # n_predict 0 (llama.vim sends it to warm the cache with other files): the prompt is
    # computed and kept, as llama-server does; the one token generated is not returned.
    warm_only = body.n_predict == 0
    max_tokens = completion_budget(
        len(prompt),
        None if body.n_predict < 0 else max(body.n_predict, 1),
        loaded.context_length,
        options.default_max_tokens,
        prompt_param="input_prefix",
        max_tokens_param="n_predict",
        clamp=True,  # llama.cpp reads n_predict as an upper bound
    )
    words = body.stop_words
    answer = _Answer(loaded.model_id, words, truncated, warm_only)
    generation = submit(
        engine,
        GenerationRequest(
            prompt_tokens=prompt,
            max_tokens=max_tokens,
            sampling=sampling(body, options.vocab_size),
            stop=[*words, *fim.stops],
            logits_processors=list(extra_processors or []),
            request_id=new_id("infill"),
            continuation=True,
            use_prompt_cache=body.cache_prompt,
        ),
        tracker=request.app.state.tracker,
    )
    if body.stream:
        chunks = _stream(generation, answer)
        return EventStream(sse_events(generation, chunks, done=False))
    parts: list[str] = []
    async with cancel_on_disconnect(request, generation):
        async for piece in generation.pieces():
            answer.clock.tick()
            parts.append(piece)
    return _final(generation, answer, "" if warm_only else "".join(parts))


def infill_prompt(
    tokenizer: Any, body: InfillRequest, room: int
) -> tuple[list[int], FimTokens, bool]:
    """The body's FIM prompt within `room` tokens, and whether something was left out to
    fit (400 naming input_suffix for a model without FIM tokens).

    What does not fit is cut as llama.cpp cuts it: the other files first (whole
    chunks, the oldest), then the prefix from its start and the suffix from its
    end (a quarter of the room for the suffix), keeping the code at the cursor.
    """
    fim = require_fim(tokenizer, "input_suffix")
    prefix = encode_text(tokenizer, body.input_prefix, "input_prefix")
    prefix += encode_text(tokenizer, body.prompt, "prompt")
    suffix = encode_text(tokenizer, body.input_suffix, "input_suffix")
    text_room = room - len(arrange(fim, [], []))
    truncated = 0 < text_room < len(prefix) + len(suffix)
    if truncated:
        keep_suffix = min(len(suffix), text_room // 4)
        keep_prefix = min(len(prefix), text_room - keep_suffix)
        keep_suffix = min(len(suffix), text_room - keep_prefix)
        prefix, suffix = prefix[len(prefix) - keep_prefix :], suffix[:keep_suffix]
    chunks = [(chunk.filename, chunk.text) for chunk in body.input_extra]
    budget = max(text_room - len(prefix) - len(suffix), 0)
    context, dropped = repo_context(tokenizer, fim, chunks, "input_extra", budget)
    return arrange(fim, prefix, suffix, context), fim, truncated or dropped > 0


def sampling(body: InfillRequest, vocab_size: int) -> SamplingParams:
    """llama.cpp's sampling fields, with llama.cpp's defaults for the ones not sent."""
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    top_k = DEFAULT_TOP_K if body.top_k is None else body.top_k
    return SamplingParams(
        # Below GREEDY_BELOW sampling would divide by ~0: greedy instead.
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=DEFAULT_TOP_P if body.top_p is None else body.top_p,
        # top_k at or above the vocabulary size keeps every token: the same as off.
        top_k=top_k if 0 < top_k < vocab_size else 0,
        min_p=DEFAULT_MIN_P if body.min_p is None else body.min_p,
        seed=None if body.seed is None or body.seed < 0 else body.seed,
        repetition_penalty=body.repeat_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
    )


class _Clock:
    """When the generation started, wrote its first text, and ended (llama.cpp's timings)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None

    def tick(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def timings(self, outcome: DoneEvent, predicted_n: int) -> InfillTimings:
        end = time.perf_counter()
        first = self.first if self.first is not None else end
        prompt_n = outcome.prompt_tokens - outcome.cached_tokens
        prompt_ms = (first - self.start) * 1000
        predicted_ms = (end - first) * 1000
        return InfillTimings(
            prompt_n=prompt_n,
            prompt_ms=prompt_ms,
            prompt_per_token_ms=prompt_ms / max(prompt_n, 1),
            prompt_per_second=1000 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
            predicted_n=predicted_n,
            predicted_ms=predicted_ms,
            predicted_per_token_ms=predicted_ms / max(predicted_n, 1),
            predicted_per_second=1000 * predicted_n / predicted_ms if predicted_ms > 0 else 0.0,
        )


@dataclass
class _Answer:
    """What the response reports beside the generation's outcome."""

    model: str
    words: list[str]  # the request's stop words
    truncated: bool
    warm_only: bool  # n_predict 0: the generated token is not returned
    clock: _Clock = field(default_factory=_Clock)


def _final(generation: Generation, answer: _Answer, content: str) -> InfillResponse:
    outcome = generation.outcome
    assert outcome is not None
    if answer.warm_only or outcome.finish_reason == "length":
        stop_type, word = "limit", ""
    elif outcome.stop_sequence is not None and outcome.stop_sequence in answer.words:
        stop_type, word = "word", outcome.stop_sequence
    else:  # the model's end of sequence, or a FIM end token (a stop string of ours)
        stop_type, word = "eos", ""
    predicted = 0 if answer.warm_only else outcome.completion_tokens
    return InfillResponse(
        content=content,
        model=answer.model,
        tokens_predicted=predicted,
        tokens_evaluated=outcome.prompt_tokens,
        tokens_cached=outcome.cached_tokens,
        truncated=answer.truncated,
        stop_type=stop_type,
        stopping_word=word,
        timings=answer.clock.timings(outcome, predicted),
    )


async def _stream(generation: Generation, answer: _Answer) -> AsyncIterator[str]:
    async for piece in generation.pieces():
        answer.clock.tick()
        if not answer.warm_only:
            yield InfillChunk(content=piece).model_dump_json()
    # The last chunk carries the totals; its content is empty (all of it was sent).
    yield _final(generation, answer, "").model_dump_json()
