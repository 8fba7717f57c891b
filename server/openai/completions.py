"""POST /v1/completions (legacy text completion) in the OpenAI dialect, streaming and not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from sse_starlette import EventSourceResponse

from flashserve.engine.generation.requests import GenerationRequest
from flashserve.engine.generation.worker import Engine
from flashserve.engine.weights.model import LoadedModel
from flashserve.server.chat.conversation import PromptLimits
from flashserve.server.chat.prompts import check_unicode, encode, run_render_job
from flashserve.server.generation import (
    Generation,
    cancel_on_disconnect,
    completion_budget,
    new_id,
    now,
    sse_events,
    submit,
)
from flashserve.server.http.errors import invalid_request
from flashserve.server.openai.common import sampling_params, usage
from flashserve.server.openai.protocol import Completion, CompletionChoice, CompletionRequest


async def create_completion(
    body: CompletionRequest,
    request: Request,
    loaded: LoadedModel,
    engine: Engine,
    default_max_tokens: int,
    vocab_size: int,
    limits: PromptLimits | None = None,
) -> Completion | EventSourceResponse:
    # Tokenizing is CPU work: on a render thread, within template_timeout (chat/prompts.py).
    prompt = await run_render_job(
        lambda deadline: encode_completion_prompt(loaded.tokenizer, body.prompt, vocab_size),
        limits or PromptLimits(),
        "prompt",
    )
    max_tokens = completion_budget(
        len(prompt),
        body.max_tokens,
        loaded.context_length,
        default_max_tokens,
        prompt_param="prompt",
    )
    completion = Completion(id=new_id("cmpl"), created=now(), model=loaded.model_id, choices=[])
    generation = submit(
        engine,
        GenerationRequest(
            prompt_tokens=prompt,
            max_tokens=max_tokens,
            sampling=sampling_params(body, vocab_size),
            stop=body.stop_list,
            request_id=completion.id,
        ),
        tracker=request.app.state.tracker,
    )
    if body.stream:
        return EventSourceResponse(
            sse_events(generation, _stream(generation, completion, body.include_usage)), sep="\n"
        )
    async with cancel_on_disconnect(request, generation):
        text = "".join([piece async for piece in generation.pieces()])
    outcome = generation.outcome
    assert outcome is not None
    completion.choices = [CompletionChoice(text=text, finish_reason=outcome.finish_reason)]
    completion.usage = usage(
        outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens
    )
    return completion


async def _stream(
    generation: Generation, header: Completion, include_usage: bool
) -> AsyncIterator[str]:
    def chunk(text: str, finish_reason: str | None = None) -> str:
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return header.model_copy(update={"choices": [choice]}).model_dump_json()

    async for piece in generation.pieces():
        yield chunk(piece)
    outcome = generation.outcome
    assert outcome is not None
    yield chunk("", outcome.finish_reason)
    if include_usage:
        stats = usage(outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens)
        yield header.model_copy(update={"usage": stats}).model_dump_json()


def encode_completion_prompt(tokenizer: Any, prompt: Any, vocab_size: int) -> list[int]:
    """A /v1/completions prompt (a string or token ids, one prompt) -> token ids."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        tokens = encode(tokenizer, check_unicode(prompt, "prompt"), add_special_tokens=True)
    else:
        tokens = [int(t) for t in prompt]
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise invalid_request(
                f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                "prompt",
            )
    if not tokens:
        raise invalid_request("The prompt is empty.", "prompt")
    return tokens
