"""POST/GET/DELETE /v1/responses (server/openai/responses.py translates)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from flashserve.server.http.deps import (
    ExtraProcessors,
    SettingsDep,
    vocab_size,
)
from flashserve.server.http.errors import error_responses
from flashserve.server.http.loading import answer
from flashserve.server.http.openapi import event_stream
from flashserve.server.http.sse import EventStream
from flashserve.server.openai.response_store import ResponseStore
from flashserve.server.openai.responses import create_response, not_found
from flashserve.server.openai.responses_protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    OutputItemEvent,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    ReasoningTextDeltaEvent,
    ReasoningTextDoneEvent,
    ResponseCreateRequest,
    ResponseDeleted,
    ResponseEvent,
    ResponseObject,
)
from flashserve.server.routes.chat import chat_options

router = APIRouter(tags=["responses"])

# Each event's data is one of these; `error` precedes response.failed; no [DONE].
_STREAM = event_stream(
    ResponseEvent,
    OutputItemEvent,
    ContentPartEvent,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    ReasoningTextDeltaEvent,
    ReasoningTextDoneEvent,
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    error=ErrorEvent,
    done=False,
)


def response_store(request: Request, settings: SettingsDep) -> ResponseStore:
    """The app's response store, made on first use (its file is opened on first access)."""
    state = request.app.state
    store = getattr(state, "response_store", None)
    if store is None:
        store = state.response_store = ResponseStore(settings.data_dir, settings.response_store_max)
    return store


StoreDep = Annotated[ResponseStore, Depends(response_store)]


@router.post(
    "/v1/responses",
    response_model=ResponseObject,
    responses={**_STREAM, **error_responses(400, 404, 429, 503)},
)
async def create(
    body: ResponseCreateRequest,
    request: Request,
    settings: SettingsDep,
    store: StoreDep,
    extra_processors: ExtraProcessors,
) -> ResponseObject | EventStream:
    return await answer(
        request,
        body.model,
        bool(body.stream),
        "responses",
        lambda engine, loaded: create_response(
            body,
            request,
            loaded,
            engine,
            chat_options(settings),
            vocab_size(loaded),
            store,
            extra_processors,
        ),
    )


@router.get(
    "/v1/responses/{response_id}",
    response_model=ResponseObject,
    responses=error_responses(404),
)
async def retrieve(response_id: str, store: StoreDep) -> JSONResponse:
    stored = await store.get(response_id)
    if stored is None:
        raise not_found(response_id)
    return JSONResponse(stored.response)


@router.delete(
    "/v1/responses/{response_id}",
    response_model=ResponseDeleted,
    responses=error_responses(404),
)
async def delete(response_id: str, store: StoreDep) -> ResponseDeleted:
    if not await store.delete(response_id):
        raise not_found(response_id)
    return ResponseDeleted(id=response_id)
