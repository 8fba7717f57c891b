"""POST /infill, llama.cpp's fill-in-the-middle route (server/llamacpp/infill.py does the work)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from flashserve.server.chat.prompts import prompt_limits
from flashserve.server.http.deps import (
    ExtraProcessors,
    SettingsDep,
    serving,
    vocab_size,
)
from flashserve.server.http.errors import error_responses
from flashserve.server.http.openapi import event_stream
from flashserve.server.http.sse import EventStream
from flashserve.server.llamacpp.infill import InfillOptions, create_infill
from flashserve.server.llamacpp.protocol import InfillChunk, InfillRequest, InfillResponse

router = APIRouter(tags=["infill"])


@router.post(
    "/infill",
    response_model=InfillResponse,
    responses={
        **event_stream(InfillChunk, InfillResponse, done=False),
        **error_responses(400, 429, 503),
    },
)
async def infill(
    body: InfillRequest,
    request: Request,
    settings: SettingsDep,
    extra_processors: ExtraProcessors,
) -> InfillResponse | EventStream:
    # llama.cpp's /infill names no model: the default one (or `model`, as its router takes).
    async with serving(request, getattr(body, "model", None)) as (engine, loaded):
        options = InfillOptions(
            settings.default_max_tokens, vocab_size(loaded), prompt_limits(settings)
        )
        return await create_infill(body, request, loaded, engine, options, extra_processors)
