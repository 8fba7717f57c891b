"""POST /v1/responses in the OpenAI Responses dialect, streaming (typed SSE events) and not.

In: openai/responses_input.py turns the body (after the stored conversation
of `previous_response_id`) into the chat pipeline's ChatRequest. Out: one
OutputAssembler turns the pipeline's output events into output items
(reasoning, message, function_call) and, for a stream, the events that build
them, so streamed and non-streamed responses agree. A response with `store`
goes into the ResponseStore (openai/response_store.py) before its last event
or its body is sent, so a client can continue from it at once.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import Request

from flashserve.engine.generation.requests import LogitsProcessor
from flashserve.engine.generation.worker import Engine
from flashserve.engine.weights.model import LoadedModel
from flashserve.server.chat.conversation import (
    ChatOptions,
    Finished,
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    ToolCallDropped,
)
from flashserve.server.chat.pipeline import ChatTurn, start_chat
from flashserve.server.chat.prompts import encode
from flashserve.server.generation import cancel_on_disconnect, now, with_keepalive
from flashserve.server.http.errors import SERVER_ERROR, APIError
from flashserve.server.http.images import ImageParts
from flashserve.server.http.sse import EventStream
from flashserve.server.openai.common import DEFAULT_TEMPERATURE
from flashserve.server.openai.response_store import ResponseStore
from flashserve.server.openai.responses_input import ResponsesInput, chat_request
from flashserve.server.openai.responses_protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItemEvent,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    OutputTokensDetails,
    ReasoningText,
    ReasoningTextDeltaEvent,
    ReasoningTextDoneEvent,
    ResponseCreateRequest,
    ResponseErrorInfo,
    ResponseEvent,
    ResponseObject,
    ResponseUsage,
    StreamEvent,
)

log = logging.getLogger(__name__)

OutputModel = OutputMessage | OutputReasoning | OutputFunctionCall
# The pipeline's names for fields, as this dialect calls them.
_PARAMS = {"response_format": "text.format"}


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def not_found(response_id: str, param: str | None = None) -> APIError:
    shown = response_id if len(response_id) <= 80 else response_id[:80] + "..."
    what = "Previous response" if param else "Response"
    return APIError(
        404,
        f"{what} with id '{shown}' not found.",
        param=param,
        code="previous_response_not_found" if param else "not_found",
    )


def _dialect_param(exc: APIError) -> APIError:
    param = exc.detail.param
    if param is not None:
        for ours, theirs in _PARAMS.items():
            if param == ours or param.startswith(ours + "."):
                exc.detail.param = theirs + param[len(ours) :]
    return exc


async def create_response(
    body: ResponseCreateRequest,
    request: Request,
    loaded: LoadedModel,
    engine: Engine,
    options: ChatOptions,
    vocab_size: int,
    store: ResponseStore,
    extra_processors: Sequence[LogitsProcessor] = (),
) -> ResponseObject | EventStream:
    prior: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = await store.get(body.previous_response_id)
        if stored is None:
            raise not_found(body.previous_response_id, "previous_response_id")
        prior = stored.conversation
    resolved = chat_request(body, prior, vocab_size, ImageParts(loaded.vision, options.images))
    base = _base_response(body, loaded.model_id, store.enabled)
    try:
        turn = await start_chat(
            resolved.request,
            loaded,
            engine,
            options,
            request_id=base.id,
            tracker=request.app.state.tracker,
            extra_processors=extra_processors,
        )
    except APIError as exc:
        raise _dialect_param(exc) from None
    assembler = OutputAssembler()

    async def finish() -> ResponseObject:
        response = await _final_response(base, assembler, loaded.tokenizer)
        if response.store:
            await _store(store, response, resolved)
        return response

    if body.stream:
        events = _stream(turn, base, assembler, finish, options.stream_keepalive)
        return EventStream(events)
    async with cancel_on_disconnect(request, turn.generation):
        try:
            async for event in turn.events():
                assembler.add(event)
        except APIError as exc:
            raise _dialect_param(exc) from None
    return await finish()


def _base_response(body: ResponseCreateRequest, model: str, store_enabled: bool) -> ResponseObject:
    """The response before any output: the request's fields echoed, as the SDK expects."""
    text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {}
    text.setdefault("format", {"type": "text"})
    return ResponseObject(
        id=new_item_id("resp"),
        created_at=now(),
        status="in_progress",
        model=model,
        instructions=body.instructions,
        previous_response_id=body.previous_response_id,
        tools=body.tools or [],
        tool_choice=body.tool_choice or "auto",
        parallel_tool_calls=body.parallel_tool_calls is not False,
        text=text,
        reasoning=body.reasoning.model_dump(exclude_none=True) if body.reasoning else None,
        max_output_tokens=body.max_output_tokens,
        temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        truncation=body.truncation or "disabled",
        store=body.store is not False and store_enabled,
        metadata=body.metadata or {},
        user=body.user,
        prompt_cache_key=body.prompt_cache_key,
    )


async def _final_response(
    base: ResponseObject, assembler: OutputAssembler, tokenizer: Any
) -> ResponseObject:
    finished = assembler.finished
    assert finished is not None
    reasoning_tokens = 0
    if assembler.reasoning_text:
        # Re-tokenized off the event loop (tokenizing is CPU work).
        ids = await asyncio.to_thread(
            encode, tokenizer, assembler.reasoning_text, add_special_tokens=False
        )
        reasoning_tokens = min(len(ids), finished.completion_tokens)
    cut = finished.reason == "length"
    return base.model_copy(
        update={
            "status": "incomplete" if cut else "completed",
            "completed_at": None if cut else now(),
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None,
            "output": list(assembler.items),
            "usage": ResponseUsage(
                input_tokens=finished.prompt_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=finished.cached_tokens),
                output_tokens=finished.completion_tokens,
                output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
                total_tokens=finished.prompt_tokens + finished.completion_tokens,
            ),
        }
    )


async def _store(store: ResponseStore, response: ResponseObject, resolved: ResponsesInput) -> None:
    """Keep the response and its conversation; a store that fails is logged, not fatal."""
    conversation = resolved.items + [item.model_dump(mode="json") for item in response.output]
    try:
        await store.put(response.model_dump(mode="json"), conversation)
    except (sqlite3.Error, OSError) as exc:
        log.error("could not store response %s in %s: %s", response.id, store.path, exc)


def _sse(event: StreamEvent) -> dict[str, str]:
    return {"event": event.type, "data": event.model_dump_json()}


async def _stream(
    turn: ChatTurn,
    base: ResponseObject,
    assembler: OutputAssembler,
    finish: Callable[[], Awaitable[ResponseObject]],
    keepalive: float,
) -> AsyncIterator[dict[str, str]]:
    """The typed events of one response. A failure after the stream began becomes an
    `error` event and then `response.failed` (the status can no longer change).
    sse-starlette cancels this generator when the client goes, and the finally
    block then cancels the generation."""
    seq = assembler.sequence
    try:
        yield _sse(ResponseEvent(type="response.created", response=base, sequence_number=seq()))
        yield _sse(ResponseEvent(type="response.in_progress", response=base, sequence_number=seq()))
        try:
            async for event in with_keepalive(turn.events(), keepalive):
                if event is None:
                    # A keepalive: Codex's idle timer counts events, not SSE comments.
                    yield _sse(
                        ResponseEvent(
                            type="response.in_progress", response=base, sequence_number=seq()
                        )
                    )
                    continue
                for out in assembler.add(event):
                    yield _sse(out)
            response = await finish()
        except APIError as exc:
            error = _dialect_param(exc).detail
        except Exception as exc:  # a bug: tell the client, keep serving
            log.exception("response %s failed", base.id)
            error = APIError(500, f"{type(exc).__name__}: {exc}", type=SERVER_ERROR).detail
        else:
            kind = (
                "response.incomplete" if response.status == "incomplete" else "response.completed"
            )
            yield _sse(ResponseEvent(type=kind, response=response, sequence_number=seq()))
            return
        code = error.code or SERVER_ERROR
        yield _sse(
            ErrorEvent(code=code, message=error.message, param=error.param, sequence_number=seq())
        )
        failed = base.model_copy(
            update={
                "status": "failed",
                "error": ResponseErrorInfo(code=code, message=error.message),
                "output": list(assembler.items),
            }
        )
        yield _sse(ResponseEvent(type="response.failed", response=failed, sequence_number=seq()))
    finally:
        turn.generation.cancel()


class _Open:
    """The output item being written: its model, position, and text so far."""

    def __init__(self, item: OutputModel, index: int, call_index: int | None = None):
        self.item = item
        self.index = index
        self.call_index = call_index  # the pipeline's index of a function call
        self.text = ""


class OutputAssembler:
    """Output events -> output items, and the stream events that build them.

    An item opens when the first event of its kind arrives after another kind
    (reasoning, text, or a new call) and closes when the next opens or the
    output ends. A call the pipeline drops after announcing it (malformed once
    complete, or cut off) is closed without its done events and left out of
    `items`; its output index is not reused, so a client's snapshot stays aligned.
    """

    def __init__(self) -> None:
        self.items: list[OutputModel] = []
        self.finished: Finished | None = None
        self.reasoning_text = ""
        self._open: _Open | None = None
        self._next_index = 0
        self._seq = 0

    def sequence(self) -> int:
        """The next event's sequence_number."""
        self._seq += 1
        return self._seq - 1

    def add(self, event: OutputEvent) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        current = self._open
        if isinstance(event, TextDelta):
            if current is None or not isinstance(current.item, OutputMessage):
                out += self._close() + self._start(OutputMessage(id="", status="in_progress"))
            out.append(self._text_delta(event.text, OutputTextDeltaEvent))
        elif isinstance(event, ReasoningDelta):
            self.reasoning_text += event.text
            if current is None or not isinstance(current.item, OutputReasoning):
                out += self._close() + self._start(OutputReasoning(id="", status="in_progress"))
            out.append(self._text_delta(event.text, ReasoningTextDeltaEvent))
        elif isinstance(event, ToolCallDelta):
            if event.id is not None:
                call = OutputFunctionCall(
                    id="",
                    call_id=event.id,
                    name=event.name or "",
                    arguments="",
                    status="in_progress",
                )
                out += self._close() + self._start(call, event.index)
            out += self._arguments(event)
        elif isinstance(event, ToolCallDropped):
            if current is not None and current.call_index == event.index:
                self._open = None
        else:
            self.finished = event
            out += self._close(cut=event.reason == "length")
        return out

    # -- helpers -------------------------------------------------------------------

    def _start(self, item: OutputModel, call_index: int | None = None) -> list[StreamEvent]:
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[item.type]
        item.id = new_item_id(prefix)
        opened = self._open = _Open(item, self._next_index, call_index)
        self._next_index += 1
        out: list[StreamEvent] = [
            OutputItemEvent(
                type="response.output_item.added",
                output_index=opened.index,
                item=item.model_copy(deep=True),
                sequence_number=self.sequence(),
            )
        ]
        part = self._part(opened)
        if part is not None:
            out.append(self._part_event("response.content_part.added", opened, part))
        return out

    @staticmethod
    def _part(opened: _Open) -> OutputText | ReasoningText | None:
        if isinstance(opened.item, OutputMessage):
            return OutputText(text=opened.text)
        if isinstance(opened.item, OutputReasoning):
            return ReasoningText(text=opened.text)
        return None

    def _part_event(
        self, kind: str, opened: _Open, part: OutputText | ReasoningText
    ) -> ContentPartEvent:
        return ContentPartEvent(
            type=kind,  # type: ignore[arg-type]
            item_id=opened.item.id,
            output_index=opened.index,
            part=part,
            sequence_number=self.sequence(),
        )

    def _text_delta(
        self, text: str, kind: type[OutputTextDeltaEvent] | type[ReasoningTextDeltaEvent]
    ) -> StreamEvent:
        opened = self._open
        assert opened is not None
        opened.text += text
        return kind(
            item_id=opened.item.id,
            output_index=opened.index,
            delta=text,
            sequence_number=self.sequence(),
        )

    def _arguments(self, event: ToolCallDelta) -> list[StreamEvent]:
        opened = self._open
        if not event.arguments:
            return []
        if opened is None or opened.call_index != event.index:
            log.warning("arguments for call %d arrived outside its item; left out", event.index)
            return []
        opened.text += event.arguments
        return [
            ArgumentsDeltaEvent(
                item_id=opened.item.id,
                output_index=opened.index,
                delta=event.arguments,
                sequence_number=self.sequence(),
            )
        ]

    def _close(self, cut: bool = False) -> list[StreamEvent]:
        """Close the open item: its done events; it joins `items`."""
        opened, self._open = self._open, None
        if opened is None:
            return []
        item, out = opened.item, []
        if isinstance(item, OutputFunctionCall):
            item.arguments = opened.text
            item.status = "completed"  # a call the pipeline keeps is complete
            out.append(
                ArgumentsDoneEvent(
                    item_id=item.id,
                    output_index=opened.index,
                    name=item.name,
                    arguments=item.arguments,
                    sequence_number=self.sequence(),
                )
            )
        else:
            done: StreamEvent
            if isinstance(item, OutputMessage):
                item.content = [OutputText(text=opened.text)]
                done = OutputTextDoneEvent(
                    item_id=item.id,
                    output_index=opened.index,
                    text=opened.text,
                    sequence_number=self.sequence(),
                )
            else:
                item.content = [ReasoningText(text=opened.text)]
                done = ReasoningTextDoneEvent(
                    item_id=item.id,
                    output_index=opened.index,
                    text=opened.text,
                    sequence_number=self.sequence(),
                )
            item.status = "incomplete" if cut else "completed"
            part = self._part(opened)
            assert part is not None
            out += [done, self._part_event("response.content_part.done", opened, part)]
        out.append(
            OutputItemEvent(
                type="response.output_item.done",
                output_index=opened.index,
                item=item.model_copy(deep=True),
                sequence_number=self.sequence(),
            )
        )
        self.items.append(item)
        return out
