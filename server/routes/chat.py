"""POST /v1/chat/completions, streaming (SSE) and not.

The output path: engine text pieces -> OutputProcessor (server/output.py) ->
ChatDeltas -> SSE chunks, or folded by MessageBuilder into one message.
"""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from sse_starlette import EventSourceResponse

from engine.loader import LoadedModel
from engine.requests import GenerationRequest
from engine.worker import Engine

from ..chat_tools import ChatOutputProcessor, constraint_processors, plan_chat, template_inputs
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
from ..output import MessageBuilder, OutputProcessor
from ..prompts import render_chat
from ..schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
)
from ..settings import Settings

router = APIRouter(tags=["chat"])


@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    loaded: LoadedModel = Depends(ready_model),
    engine: Engine = Depends(get_engine),
    settings: Settings = Depends(get_settings),
) -> ChatCompletion | EventSourceResponse:
    check_model(body.model, loaded, settings)
    plan = plan_chat(body, loaded.tokenizer, settings)
    prompt_text, prompt = render_chat(
        loaded.tokenizer, body, adapt=lambda messages: template_inputs(plan, messages)
    )
    max_tokens = completion_budget(
        len(prompt),
        body.requested_max_tokens,
        loaded.context_length,
        settings.default_max_tokens,
        prompt_param="messages",
        max_tokens_param=(
            "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        ),
    )
    sampling = sampling_params(body, vocab_size(loaded))
    # tool_choice required / named and response_format, by constrained decoding.
    processors = await constraint_processors(plan, loaded.tokenizer, prompt_text)
    test_hook = getattr(request.app.state, "test_logits_hook", None)  # tests/scripted.py only
    if test_hook is not None:
        processors += test_hook(request, loaded.tokenizer)
    completion_id = new_id("chatcmpl")
    generation = submit(
        engine,
        GenerationRequest(
            prompt_tokens=prompt,
            max_tokens=max_tokens,
            sampling=sampling,
            stop=body.stop_list,
            logits_processors=processors,
            request_id=completion_id,
        ),
        tracker=request.app.state.tracker,
    )
    processor = ChatOutputProcessor(plan, prompt_text)
    header = _ChunkHeader(completion_id, now(), loaded.model_id)
    if body.stream:
        return EventSourceResponse(
            sse_events(generation, _stream(generation, processor, header, body.include_usage)),
            sep="\n",
        )
    builder = MessageBuilder()
    async with cancel_on_disconnect(request, generation):
        async for piece in generation.pieces():
            builder.add(processor.feed(piece))
    builder.add(processor.finish())
    assert generation.outcome is not None
    return ChatCompletion(
        id=header.id,
        created=header.created,
        model=header.model,
        choices=[
            ChatChoice(
                message=builder.message(),
                finish_reason=processor.finish_reason(generation.outcome.finish_reason),
            )
        ],
        usage=generation.usage(),
    )


class _ChunkHeader:
    """What every chunk of one response repeats."""

    def __init__(self, id: str, created: int, model: str):
        self.id, self.created, self.model = id, created, model

    def chunk(self, delta: ChatDelta, finish_reason: str | None = None) -> str:
        return ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)],
        ).model_dump_json()


async def _stream(
    generation: Generation,
    processor: OutputProcessor,
    header: _ChunkHeader,
    include_usage: bool,
) -> AsyncIterator[str]:
    yield header.chunk(ChatDelta(role="assistant", content=""))
    async for piece in generation.pieces():
        for delta in processor.feed(piece):
            yield header.chunk(delta)
    for delta in processor.finish():
        yield header.chunk(delta)
    assert generation.outcome is not None
    yield header.chunk(ChatDelta(), processor.finish_reason(generation.outcome.finish_reason))
    if include_usage:
        yield ChatCompletionChunk(
            id=header.id,
            created=header.created,
            model=header.model,
            choices=[],
            usage=generation.usage(),
        ).model_dump_json()
