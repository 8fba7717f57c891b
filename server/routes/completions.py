"""POST /v1/completions (legacy text completion), streaming (SSE) and not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from sse_starlette import EventSourceResponse

from engine.loader import LoadedModel
from engine.requests import GenerationRequest
from engine.worker import Engine

from ..deps import check_model, get_engine, get_settings, ready_model, vocab_size
from ..generation import (
    Generation,
    cancel_on_disconnect,
    completion_budget,
    new_id,
    now,
    sampling_params,
    sse_events,
    submit,
)
from ..prompts import encode_completion_prompt
from ..schemas import Completion, CompletionChoice, CompletionRequest
from ..settings import Settings

router = APIRouter(tags=["completions"])


@router.post("/v1/completions", response_model=Completion)
async def completions(
    body: CompletionRequest,
    request: Request,
    loaded: LoadedModel = Depends(ready_model),
    engine: Engine = Depends(get_engine),
    settings: Settings = Depends(get_settings),
) -> Completion | EventSourceResponse:
    check_model(body.model, loaded, settings)
    vocab = vocab_size(loaded)
    prompt = encode_completion_prompt(loaded.tokenizer, body.prompt, vocab)
    max_tokens = completion_budget(
        len(prompt),
        body.max_tokens,
        loaded.context_length,
        settings.default_max_tokens,
        prompt_param="prompt",
    )
    completion = Completion(id=new_id("cmpl"), created=now(), model=loaded.model_id, choices=[])
    generation = submit(
        engine,
        GenerationRequest(
            prompt_tokens=prompt,
            max_tokens=max_tokens,
            sampling=sampling_params(body, vocab),
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
    assert generation.outcome is not None
    completion.choices = [
        CompletionChoice(text=text, finish_reason=generation.outcome.finish_reason)
    ]
    completion.usage = generation.usage()
    return completion


async def _stream(
    generation: Generation, header: Completion, include_usage: bool
) -> AsyncIterator[str]:
    def chunk(text: str, finish_reason: str | None = None) -> str:
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return header.model_copy(update={"choices": [choice]}).model_dump_json()

    async for piece in generation.pieces():
        yield chunk(piece)
    assert generation.outcome is not None
    yield chunk("", generation.outcome.finish_reason)
    if include_usage:
        yield header.model_copy(update={"usage": generation.usage()}).model_dump_json()
