"""POST /v1/messages and /v1/messages/count_tokens (server/anthropic/ translates).

Errors on these paths come in Anthropic's shape: server/http/errors.py picks
the shape by path, for the routes' errors and the middleware's alike.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from flashserve.server.anthropic.messages import count_tokens, create_message
from flashserve.server.anthropic.protocol import (
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    CountTokensRequest,
    CountTokensResponse,
    Message,
    MessageDeltaEvent,
    MessagesRequest,
    MessageStartEvent,
    MessageStopEvent,
    PingEvent,
)
from flashserve.server.http.deps import (
    ExtraProcessors,
    SettingsDep,
    serving,
    vocab_size,
)
from flashserve.server.http.errors import AnthropicErrorResponse, error_responses
from flashserve.server.http.ignored import note_ignored
from flashserve.server.http.loading import answer
from flashserve.server.http.openapi import event_stream
from flashserve.server.http.sse import EventStream
from flashserve.server.routes.chat import chat_options

router = APIRouter(tags=["messages"])

# Beta features whose request shapes this server takes; other flags are accepted
# (a client sends a dozen) and logged once each.
HONOURED_BETAS = frozenset({"mid-conversation-system-2026-04-07"})


def note_betas(header: str | None) -> None:
    flags = {flag.strip() for flag in (header or "").split(",") if flag.strip()}
    note_ignored("anthropic-beta", sorted(flags - HONOURED_BETAS), what="flag")


# 401 and 413 come from the middleware: server/http/openapi.py lists them on every route.
_ERRORS = error_responses(400, 404, 429, 500, 503, model=AnthropicErrorResponse)
# With `stream: true`: each event is named by its data's `type`; a failure after the
# headers went out is an `error` event. No [DONE]: message_stop ends the stream.
_STREAM = event_stream(
    MessageStartEvent,
    PingEvent,
    ContentBlockStartEvent,
    ContentBlockDeltaEvent,
    ContentBlockStopEvent,
    MessageDeltaEvent,
    MessageStopEvent,
    error=AnthropicErrorResponse,
    done=False,
)


@router.post("/v1/messages", response_model=Message, responses={**_ERRORS, **_STREAM})
async def messages(
    body: MessagesRequest,
    request: Request,
    settings: SettingsDep,
    extra_processors: ExtraProcessors,
) -> Message | EventStream:
    note_betas(request.headers.get("anthropic-beta"))
    return await answer(
        request,
        body.model,
        bool(body.stream),
        "messages",
        lambda engine, loaded: create_message(
            body,
            request,
            loaded,
            engine,
            chat_options(settings),
            vocab_size(loaded),
            extra_processors,
        ),
    )


@router.post(
    "/v1/messages/count_tokens",
    response_model=CountTokensResponse,
    responses=error_responses(400, 404, 500, 503, model=AnthropicErrorResponse),
)
async def messages_count_tokens(
    body: CountTokensRequest, request: Request, settings: SettingsDep
) -> CountTokensResponse:
    async with serving(request, body.model) as (_, loaded):
        return await count_tokens(body, loaded, chat_options(settings), vocab_size(loaded))
