"""POST /v1/chat/completions in the OpenAI dialect, streaming (SSE) and not.

In: the request body becomes the chat pipeline's ChatRequest. Out: the
pipeline's output events become `chat.completion.chunk`s, or are folded by
MessageBuilder into the one message of a `chat.completion`, so both agree.
With n > 1 each choice has its own events, chunks (`choices[0].index`) and
builder; with logprobs every generated token is listed, in order, tool-call
and reasoning markup included (what the model sampled, as vLLM does).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request

from flashserve.engine.generation.requests import LogitsProcessor, TokenEvent
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
    ToolCallDropped,
)
from flashserve.server.chat.pipeline import ChatTurn, start_chat
from flashserve.server.generation import (
    cancel_on_disconnect,
    new_id,
    now,
    sse_events,
    with_keepalive,
)
from flashserve.server.http.errors import invalid_request
from flashserve.server.http.images import ImageParts
from flashserve.server.http.sse import EventStream
from flashserve.server.openai.common import choice_count, sampling_params, usage
from flashserve.server.openai.logprobs import TokenStrings, chat_logprobs, token_strings
from flashserve.server.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageOut,
    ChoiceLogprobs,
    ContentPart,
    FunctionCallOut,
    FunctionDelta,
    ImagePart,
    ToolCallOut,
    Usage,
)
from flashserve.server.openai.protocol import ToolCallDelta as ToolCallDeltaOut

Part = ContentPart | ImagePart


def chat_request(
    body: ChatCompletionRequest,
    vocab_size: int,
    max_batch: int = 1,
    images: ImageParts | None = None,
) -> ChatRequest:
    """The pipeline's request for an OpenAI chat body (400 on a bad logit_bias, n above
    max_batch, top_logprobs without logprobs, an image the model cannot take)."""
    images = images or ImageParts(None)
    if body.top_logprobs and not body.logprobs:
        raise invalid_request(
            "top_logprobs needs logprobs: true (it says how many tokens to list with each).",
            "top_logprobs",
            "invalid_value",
        )
    return ChatRequest(
        messages=[
            _template_message(m.model_dump(exclude_none=True), m.content, images, f"messages.{i}")
            for i, m in enumerate(body.messages)
        ],
        images=images.images,
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
        n=choice_count(body, max_batch),
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        speculative=body.speculative is not False,
    )


def _template_message(
    data: dict[str, Any], content: str | Sequence[Part] | None, images: ImageParts, param: str
) -> dict:
    data["content"] = content_text(content, images, param, tool=data["role"] == "tool") or ""
    if data["role"] == "developer":
        # Chat templates predate the developer role; it is a system message.
        data["role"] = "system"
    return data


def content_text(
    content: str | Sequence[Part] | None, images: ImageParts, param: str, tool: bool = False
) -> str | None:
    """A message's content as one string: text parts are joined with newlines; an
    image is the model's placeholder (server/http/images.py), in a tool message read
    by a text-only model as text that says it was left out."""
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, ContentPart):
            texts.append(part.text or "")
            continue
        at = f"{param}.content.{j}"

        def add(part: ImagePart = part, at: str = at) -> str:
            return images.data_url(part.image_url.get("url"), f"{at}.image_url.url")

        if tool:
            texts.append(images.in_tool_output(add, "a tool message (Chat Completions)"))
        else:
            images.refuse_text_only(at)
            texts.append(add())
    return "\n".join(texts)


async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    loaded: LoadedModel,
    engine: Engine,
    options: ChatOptions,
    vocab_size: int,
    extra_processors: Sequence[LogitsProcessor] = (),
) -> ChatCompletion | EventStream:
    completion_id = new_id("chatcmpl")
    parts = ImageParts(loaded.vision, options.images)
    chat = chat_request(body, vocab_size, engine.config.max_batch, parts)
    turn = await start_chat(
        chat,
        loaded,
        engine,
        options,
        request_id=completion_id,
        tracker=request.app.state.tracker,
        extra_processors=extra_processors,
    )
    header = _ChunkHeader(completion_id, now(), loaded.model_id)
    strings = token_strings(loaded.tokenizer)
    if body.stream:
        chunks = _stream(turn, header, chat.n, strings, body.include_usage, options)
        return EventStream(sse_events(turn.generation, chunks))
    builders = [MessageBuilder(strings) for _ in range(chat.n)]
    async with cancel_on_disconnect(request, turn.generation):
        async for choice in turn.choice_events():
            builders[choice.index].add(choice.event, choice.tokens)
    finished = [b.finished for b in builders]
    assert all(finished), finished
    return ChatCompletion(
        id=header.id,
        created=header.created,
        model=header.model,
        choices=[
            ChatChoice(
                index=index,
                message=builder.message(),
                finish_reason=builder.finished.reason,
                logprobs=builder.logprobs() if chat.logprobs is not None else None,
            )
            for index, builder in enumerate(builders)
            if builder.finished is not None
        ],
        usage=choices_usage([f for f in finished if f is not None]),
    )


def choices_usage(finished: Sequence[Finished]) -> Usage:
    """The prompt once (every choice shares its one prefill), every choice's tokens."""
    first = finished[0]
    completion = sum(f.completion_tokens for f in finished)
    return usage(first.prompt_tokens, completion, first.cached_tokens)


class _ChunkHeader:
    """What every chunk of one response repeats."""

    def __init__(self, id: str, created: int, model: str):
        self.id, self.created, self.model = id, created, model

    def chunk(
        self,
        delta: ChatDelta,
        finish_reason: str | None = None,
        index: int = 0,
        logprobs: ChoiceLogprobs | None = None,
    ) -> str:
        choice = ChatChunkChoice(
            index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs
        )
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice]
        ).model_dump_json()


async def _stream(
    turn: ChatTurn,
    header: _ChunkHeader,
    n: int,
    strings: TokenStrings,
    include_usage: bool,
    options: ChatOptions,
) -> AsyncIterator[str]:
    for index in range(n):
        yield header.chunk(ChatDelta(role="assistant", content=""), index=index)
    finished: list[Finished] = []
    # Tokens of a dropped call's events, which send no chunk: they go with the next one.
    carried: list[list[TokenEvent]] = [[] for _ in range(n)]
    async for choice in with_keepalive(turn.choice_events(), options.stream_keepalive):
        if choice is None:
            # A keepalive: an empty delta, the shape of OpenAI's own finish chunk
            # (which every client reads), so no client sees anything new.
            yield header.chunk(ChatDelta(), index=0)
            continue
        event, index = choice.event, choice.index
        tokens = [*carried[index], *choice.tokens]
        carried[index] = []
        if isinstance(event, ToolCallDropped):
            carried[index] = tokens  # its fragments are out; a chunk cannot take them back
            continue
        logprobs = chat_logprobs(tokens, strings)
        if not isinstance(event, Finished):
            yield header.chunk(delta(event), index=index, logprobs=logprobs)
            continue
        yield header.chunk(ChatDelta(), event.reason, index=index, logprobs=logprobs)
        finished.append(event)
    if include_usage and finished:
        yield ChatCompletionChunk(
            id=header.id,
            created=header.created,
            model=header.model,
            choices=[],
            usage=choices_usage(finished),
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
    """Folds one choice's output events into the one message of a non-streaming
    response (and its tokens into its logprobs)."""

    def __init__(self, strings: TokenStrings | None = None) -> None:
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, str]] = {}
        self._tokens: list[TokenEvent] = []
        self._strings = strings
        self.finished: Finished | None = None

    def logprobs(self) -> ChoiceLogprobs:
        assert self._strings is not None
        return chat_logprobs(self._tokens, self._strings) or ChoiceLogprobs(content=[])

    def add(self, event: OutputEvent, tokens: Sequence[TokenEvent] = ()) -> None:
        self._tokens.extend(tokens)
        if isinstance(event, TextDelta):
            self._content.append(event.text)
        elif isinstance(event, ReasoningDelta):
            self._reasoning.append(event.text)
        elif isinstance(event, ToolCallDelta):
            slot = self._calls.setdefault(event.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] = event.id or slot["id"]
            slot["name"] = event.name or slot["name"]
            slot["arguments"] += event.arguments
        elif isinstance(event, ToolCallDropped):
            self._calls.pop(event.index, None)
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
