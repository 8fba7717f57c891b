"""POST /v1/messages and /v1/messages/count_tokens in the Anthropic dialect.

In: the body becomes the chat pipeline's ChatRequest (translate.py). Out: the
pipeline's output events go through one BlockAssembler, which turns them into
Anthropic's stream events (content blocks opened, filled by deltas, closed)
and keeps the blocks of the whole message: a stream sends the events, a
non-streamed response returns the blocks, so the two agree.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from fastapi import Request

from flashserve.engine.generation.requests import LogitsProcessor
from flashserve.engine.generation.worker import Engine
from flashserve.engine.weights.model import LoadedModel
from flashserve.server.anthropic.protocol import (
    AnthropicUsage,
    ContentBlockDeltaEvent,
    ContentBlockOut,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    CountTokensRequest,
    CountTokensResponse,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageDeltaEvent,
    MessagesRequest,
    MessageStartEvent,
    MessageStopEvent,
    PingEvent,
    SignatureDelta,
    StopReason,
    StreamEvent,
    TextBlockOut,
    TextDeltaOut,
    ThinkingBlockOut,
    ThinkingDeltaOut,
    ToolUseBlockOut,
)
from flashserve.server.anthropic.translate import chat_request
from flashserve.server.chat.conversation import (
    ChatOptions,
    Finished,
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    ToolCallDropped,
)
from flashserve.server.chat.pipeline import ChatTurn, render_chat, start_chat
from flashserve.server.generation import Generation, cancel_on_disconnect, with_keepalive
from flashserve.server.http.errors import SERVER_ERROR, APIError
from flashserve.server.http.images import ImageParts
from flashserve.server.http.sse import EventStream

log = logging.getLogger(__name__)


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def tool_use_id(call_id: str) -> str:
    """The pipeline's call id in Anthropic's form (toolu_...); clients send it back
    in tool_result blocks, where any id string works."""
    return "toolu_" + call_id.removeprefix("call_")


def signature(thinking: str) -> str:
    """A thinking block's signature. Anthropic's verifies the block; clients only
    need a string to send back, and this server ignores it."""
    return hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def stop_reason(finished: Finished) -> StopReason:
    if finished.reason == "tool_calls":
        return "tool_use"
    if finished.reason == "length":
        return "max_tokens"
    return "stop_sequence" if finished.stop_sequence is not None else "end_turn"


def usage(finished: Finished) -> AnthropicUsage:
    return AnthropicUsage(
        input_tokens=finished.prompt_tokens - finished.cached_tokens,
        output_tokens=finished.completion_tokens,
        cache_read_input_tokens=finished.cached_tokens,
    )


# -- output events -> content blocks ---------------------------------------------------


@dataclass
class _Block:
    kind: str  # text | thinking | tool_use
    parts: list[str] = field(default_factory=list)
    id: str = ""
    name: str = ""
    dropped: bool = False

    def out(self) -> ContentBlockOut:
        text = "".join(self.parts)
        if self.kind == "text":
            return TextBlockOut(text=text)
        if self.kind == "thinking":
            return ThinkingBlockOut(thinking=text, signature=signature(text))
        try:
            arguments = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            # The parser completes only calls whose arguments are an object (a cut-off
            # one is dropped first): this would be a bug there, not worth a 500 here.
            log.warning("tool call %s has arguments that are no JSON object: %.200s", self.id, text)
            arguments = {}
        return ToolUseBlockOut(id=self.id, name=self.name, input=arguments)


class BlockAssembler:
    """Output events -> Anthropic stream events, and the message's content blocks.

    One block is open at a time, as in Anthropic's streams: text, reasoning
    (a thinking block) and each tool call get their own, in the order they come.
    """

    def __init__(self) -> None:
        self._blocks: list[_Block] = []  # by stream index
        self._open: int | None = None
        self._calls: dict[int, int] = {}  # the pipeline's call index -> stream index

    def feed(self, event: OutputEvent) -> list[StreamEvent]:
        if isinstance(event, TextDelta):
            return self._append("text", event.text, TextDeltaOut(text=event.text))
        if isinstance(event, ReasoningDelta):
            return self._append("thinking", event.text, ThinkingDeltaOut(thinking=event.text))
        if isinstance(event, ToolCallDelta):
            return self._tool_call(event)
        if isinstance(event, ToolCallDropped):
            return self._drop(event.index)
        raise TypeError(f"unexpected output event {event!r}")

    def finish(self, finished: Finished) -> list[StreamEvent]:
        out = self._close()
        out.append(
            MessageDeltaEvent(
                delta=MessageDelta(
                    stop_reason=stop_reason(finished), stop_sequence=finished.stop_sequence
                ),
                usage=usage(finished),
            )
        )
        out.append(MessageStopEvent())
        return out

    def content(self) -> list[ContentBlockOut]:
        """The message's blocks: what the stream sent, less calls that were dropped."""
        return [block.out() for block in self._blocks if not block.dropped]

    def _append(
        self, kind: str, text: str, delta: TextDeltaOut | ThinkingDeltaOut
    ) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if self._open is None or self._blocks[self._open].kind != kind:
            out += self._close()
            out.append(self._start(_Block(kind)))
        assert self._open is not None
        self._blocks[self._open].parts.append(text)
        out.append(ContentBlockDeltaEvent(index=self._open, delta=delta))
        return out

    def _tool_call(self, event: ToolCallDelta) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        index = self._calls.get(event.index)
        if index is None:
            # The first delta of a call carries its id and name: a new block.
            out += self._close()
            out.append(
                self._start(
                    _Block("tool_use", id=tool_use_id(event.id or ""), name=event.name or "")
                )
            )
            index = self._calls[event.index] = len(self._blocks) - 1
        if event.arguments:
            self._blocks[index].parts.append(event.arguments)
            delta = InputJsonDelta(partial_json=event.arguments)
            out.append(ContentBlockDeltaEvent(index=index, delta=delta))
        return out

    def _drop(self, call: int) -> list[StreamEvent]:
        # A stream cannot take back what it sent: the block is closed where it
        # stands (its input as far as it streamed); the whole message leaves it out.
        index = self._calls.get(call)
        if index is None:
            return []
        self._blocks[index].dropped = True
        return self._close() if self._open == index else []

    def _start(self, block: _Block) -> ContentBlockStartEvent:
        self._blocks.append(block)
        self._open = len(self._blocks) - 1
        start: ContentBlockOut
        if block.kind == "text":
            start = TextBlockOut(text="")
        elif block.kind == "thinking":
            start = ThinkingBlockOut(thinking="", signature="")
        else:
            start = ToolUseBlockOut(id=block.id, name=block.name, input={})
        return ContentBlockStartEvent(index=self._open, content_block=start)

    def _close(self) -> list[StreamEvent]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        block = self._blocks[index]
        out: list[StreamEvent] = []
        if block.kind == "thinking":
            sig = SignatureDelta(signature=signature("".join(block.parts)))
            out.append(ContentBlockDeltaEvent(index=index, delta=sig))
        out.append(ContentBlockStopEvent(index=index))
        return out


# -- serving ---------------------------------------------------------------------------


async def create_message(
    body: MessagesRequest,
    request: Request,
    loaded: LoadedModel,
    engine: Engine,
    options: ChatOptions,
    vocab_size: int,
    extra_processors: Sequence[LogitsProcessor] = (),
) -> Message | EventStream:
    message_id = new_message_id()
    turn = await start_chat(
        chat_request(body, vocab_size, ImageParts(loaded.vision, options.images)),
        loaded,
        engine,
        options,
        request_id=message_id,
        tracker=request.app.state.tracker,
        extra_processors=extra_processors,
    )
    start = Message(id=message_id, model=loaded.model_id, content=[], usage=_start_usage(turn))
    if body.stream:
        events = _stream(turn, start, options.stream_keepalive)
        return EventStream(sse(turn.generation, events, request.url.path))
    assembler = BlockAssembler()
    finished: Finished | None = None
    async with cancel_on_disconnect(request, turn.generation):
        async for event in turn.events():
            if isinstance(event, Finished):
                finished = event
            else:
                assembler.feed(event)
    assert finished is not None
    return start.model_copy(
        update={
            "content": assembler.content(),
            "stop_reason": stop_reason(finished),
            "stop_sequence": finished.stop_sequence,
            "usage": usage(finished),
        }
    )


def _start_usage(turn: ChatTurn, cached: int | None = None) -> AnthropicUsage:
    prompt = len(turn.generation.handle.request.prompt_tokens)
    cached = cached or 0
    return AnthropicUsage(
        input_tokens=prompt - cached, output_tokens=0, cache_read_input_tokens=cached
    )


async def _stream(turn: ChatTurn, start: Message, keepalive: float) -> AsyncIterator[StreamEvent]:
    # message_start's usage splits cached input as the final usage does, so it
    # waits for the worker's prompt-cache lookup: at most one keepalive interval
    # (a long queue), after which it counts the whole prompt as input.
    cached = await turn.generation.handle.wait_admitted(keepalive if keepalive > 0 else None)
    start = start.model_copy(update={"usage": _start_usage(turn, cached)})
    yield MessageStartEvent(message=start)
    yield PingEvent()  # early, as Anthropic's streams do: the client knows the stream is live
    assembler = BlockAssembler()
    async for event in with_keepalive(turn.events(), keepalive):
        if event is None:  # a long prefill: Anthropic's own keepalive event
            yield PingEvent()
            continue
        pieces = assembler.finish(event) if isinstance(event, Finished) else assembler.feed(event)
        for piece in pieces:
            yield piece


async def sse(
    generation: Generation, events: AsyncIterator[StreamEvent], path: str
) -> AsyncIterator[dict[str, str]]:
    """SSE events named by their type. A failure after the headers went out becomes
    an `error` event in Anthropic's shape (the status can no longer change).
    sse-starlette cancels this generator when the client disconnects; the finally
    block then cancels the generation."""
    try:
        async for event in events:
            yield {"event": event.type, "data": event.model_dump_json()}
    except APIError as exc:
        yield {"event": "error", "data": exc.body_json(path)}
    except Exception as exc:  # a bug: tell the client, keep serving
        log.exception("stream %s failed", generation.request_id)
        error = APIError(500, f"{type(exc).__name__}: {exc}", type=SERVER_ERROR)
        yield {"event": "error", "data": error.body_json(path)}
    finally:
        generation.cancel()


async def count_tokens(
    body: CountTokensRequest, loaded: LoadedModel, options: ChatOptions, vocab_size: int
) -> CountTokensResponse:
    """The prompt's tokens, rendered exactly as /v1/messages renders it."""
    parts = ImageParts(loaded.vision, options.images)
    _, _, prompt = await render_chat(chat_request(body, vocab_size, parts), loaded, options)
    return CountTokensResponse(input_tokens=len(prompt))
