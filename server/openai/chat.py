"""POST /v1/chat/completions in the OpenAI dialect, streaming (SSE) and not.

In: the request body becomes the chat pipeline's ChatRequest. Out: the
pipeline's output events become `chat.completion.chunk`s, or are folded by
MessageBuilder into the one message of a `chat.completion`, so both agree.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from sse_starlette import EventSourceResponse

from flashserve.engine.generation.requests import LogitsProcessor
from flashserve.engine.generation.worker import Engine
from flashserve.engine.weights.model import LoadedModel
from flashserve.server.chat.conversation import (
    ChatOptions,
    ChatRequest,
    Finished,
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
)
from flashserve.server.chat.pipeline import ChatTurn, start_chat
from flashserve.server.generation import cancel_on_disconnect, new_id, now, sse_events
from flashserve.server.openai.common import sampling_params, usage
from flashserve.server.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageOut,
    ContentPart,
    FunctionCallOut,
    FunctionDelta,
    ToolCallOut,
)
from flashserve.server.openai.protocol import ToolCallDelta as ToolCallDeltaOut


def chat_request(body: ChatCompletionRequest, vocab_size: int) -> ChatRequest:
    """The pipeline's request for an OpenAI chat body (400 on a bad logit_bias)."""
    return ChatRequest(
        messages=[
            _template_message(m.model_dump(exclude_none=True), m.content) for m in body.messages
        ],
        sampling=sampling_params(body, vocab_size),
        tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
        tool_choice=body.tool_choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        response_format=body.response_format,
        stop=body.stop_list,
        max_tokens=body.requested_max_tokens,
        chat_template_kwargs=dict(body.chat_template_kwargs or {}),
        max_tokens_param=(
            "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        ),
    )


def _template_message(data: dict[str, Any], content: str | Sequence[ContentPart] | None) -> dict:
    data["content"] = content_text(content) or ""
    if data["role"] == "developer":
        # Chat templates predate the developer role; it is a system message.
        data["role"] = "system"
    return data


def content_text(content: str | Sequence[ContentPart] | None) -> str | None:
    """A message's content as one string: text parts are joined with newlines."""
    if content is None or isinstance(content, str):
        return content
    return "\n".join(part.text or "" for part in content)


async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    loaded: LoadedModel,
    engine: Engine,
    options: ChatOptions,
    vocab_size: int,
    extra_processors: Sequence[LogitsProcessor] = (),
) -> ChatCompletion | EventSourceResponse:
    completion_id = new_id("chatcmpl")
    turn = await start_chat(
        chat_request(body, vocab_size),
        loaded,
        engine,
        options,
        request_id=completion_id,
        tracker=request.app.state.tracker,
        extra_processors=extra_processors,
    )
    header = _ChunkHeader(completion_id, now(), loaded.model_id)
    if body.stream:
        return EventSourceResponse(
            sse_events(turn.generation, _stream(turn, header, body.include_usage)), sep="\n"
        )
    builder = MessageBuilder()
    async with cancel_on_disconnect(request, turn.generation):
        async for event in turn.events():
            builder.add(event)
    assert builder.finished is not None
    return ChatCompletion(
        id=header.id,
        created=header.created,
        model=header.model,
        choices=[ChatChoice(message=builder.message(), finish_reason=builder.finished.reason)],
        usage=usage(
            builder.finished.prompt_tokens,
            builder.finished.completion_tokens,
            builder.finished.cached_tokens,
        ),
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


async def _stream(turn: ChatTurn, header: _ChunkHeader, include_usage: bool) -> AsyncIterator[str]:
    yield header.chunk(ChatDelta(role="assistant", content=""))
    async for event in turn.events():
        if not isinstance(event, Finished):
            yield header.chunk(delta(event))
            continue
        yield header.chunk(ChatDelta(), event.reason)
        if include_usage:
            yield ChatCompletionChunk(
                id=header.id,
                created=header.created,
                model=header.model,
                choices=[],
                usage=usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens),
            ).model_dump_json()


def delta(event: OutputEvent) -> ChatDelta:
    """One output event as the delta of a chat.completion.chunk."""
    if isinstance(event, TextDelta):
        return ChatDelta(content=event.text)
    if isinstance(event, ReasoningDelta):
        return ChatDelta(reasoning_content=event.text)
    assert isinstance(event, ToolCallDelta), event
    return ChatDelta(
        tool_calls=[
            ToolCallDeltaOut(
                index=event.index,
                id=event.id,
                type="function" if event.id else None,
                function=FunctionDelta(name=event.name, arguments=event.arguments),
            )
        ]
    )


class MessageBuilder:
    """Folds output events into the one message of a non-streaming response."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, str]] = {}
        self.finished: Finished | None = None

    def add(self, event: OutputEvent) -> None:
        if isinstance(event, TextDelta):
            self._content.append(event.text)
        elif isinstance(event, ReasoningDelta):
            self._reasoning.append(event.text)
        elif isinstance(event, ToolCallDelta):
            slot = self._calls.setdefault(event.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] = event.id or slot["id"]
            slot["name"] = event.name or slot["name"]
            slot["arguments"] += event.arguments
        else:
            self.finished = event

    def message(self) -> ChatMessageOut:
        calls = [
            ToolCallOut(
                id=slot["id"],
                function=FunctionCallOut(name=slot["name"], arguments=slot["arguments"]),
            )
            for _, slot in sorted(self._calls.items())
        ]
        return ChatMessageOut(
            content="".join(self._content) if (self._content or not calls) else None,
            reasoning_content="".join(self._reasoning) if self._reasoning else None,
            tool_calls=calls or None,
        )
