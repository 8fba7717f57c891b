"""POST /v1/chat/completions (server/openai/chat.py translates, server/chat/ generates)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from flashserve.server.chat.conversation import ChatOptions
from flashserve.server.chat.prompts import prompt_limits
from flashserve.server.http.deps import (
    ExtraProcessors,
    SettingsDep,
    vocab_size,
)
from flashserve.server.http.errors import error_responses
from flashserve.server.http.images import FetchLimits, ImageLimits
from flashserve.server.http.loading import answer
from flashserve.server.http.openapi import event_stream
from flashserve.server.http.sse import EventStream
from flashserve.server.openai.chat import create_chat_completion
from flashserve.server.openai.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
)
from flashserve.server.settings import Settings

router = APIRouter(tags=["chat"])


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses={**event_stream(ChatCompletionChunk), **error_responses(400, 404, 429, 503)},
)
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    settings: SettingsDep,
    extra_processors: ExtraProcessors,
) -> ChatCompletion | EventStream:
    return await answer(
        request,
        body.model,
        bool(body.stream),
        "chat",
        lambda engine, loaded: create_chat_completion(
            body,
            request,
            loaded,
            engine,
            chat_options(settings),
            vocab_size(loaded),
            extra_processors,
        ),
    )


def chat_options(settings: Settings) -> ChatOptions:
    return ChatOptions(
        tool_parser=settings.tool_parser,
        reasoning_parser=settings.reasoning_parser,
        default_max_tokens=settings.default_max_tokens,
        prompt=prompt_limits(settings),
        stream_keepalive=settings.stream_keepalive,
        history_thinking=settings.history_thinking,
        images=image_limits(settings),
    )


def image_limits(settings: Settings) -> ImageLimits:
    fetch = FetchLimits(
        settings.image_url_max_bytes, settings.image_url_timeout, settings.image_url_private
    )
    return ImageLimits(
        settings.max_images,
        settings.max_image_pixels,
        fetch if settings.allow_image_urls else None,
    )
