"""POST /v1/completions (server/openai/completions.py does the work)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from flashserve.server.chat.prompts import prompt_limits
from flashserve.server.http.deps import SettingsDep, vocab_size
from flashserve.server.http.errors import error_responses
from flashserve.server.http.loading import answer
from flashserve.server.http.openapi import event_stream
from flashserve.server.http.sse import EventStream
from flashserve.server.openai.completions import create_completion
from flashserve.server.openai.completions_protocol import Completion, CompletionRequest

router = APIRouter(tags=["completions"])


@router.post(
    "/v1/completions",
    response_model=Completion,
    responses={**event_stream(Completion), **error_responses(400, 404, 429, 503)},
)
async def completions(
    body: CompletionRequest,
    request: Request,
    settings: SettingsDep,
) -> Completion | EventStream:
    return await answer(
        request,
        body.model,
        bool(body.stream),
        "completion",
        lambda engine, loaded: create_completion(
            body,
            request,
            loaded,
            engine,
            settings.default_max_tokens,
            vocab_size(loaded),
            prompt_limits(settings),
            settings.stream_keepalive,
        ),
    )
