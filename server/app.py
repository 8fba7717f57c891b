"""The FastAPI application: shared state, error handlers, one router per resource.

The engine's worker thread starts with the app (the model loads there, so
/health answers 503 while it loads) and stops with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from flashserve.engine.generation.worker import Engine
from flashserve.server.http.errors import install_error_handlers
from flashserve.server.http.production import install_production
from flashserve.server.routes import (
    cache,
    chat,
    completions,
    dashboard,
    health,
    infill,
    memory,
    messages,
    metrics,
    models,
    responses,
)
from flashserve.server.settings import Settings

log = logging.getLogger(__name__)

VERSION = "0.1.0"


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    engine = engine if engine is not None else Engine(settings.engine_config())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            # Joining the worker blocks; keep it off the event loop.
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="flashserve", version=VERSION, lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = engine
    app.state.started_at = int(time.time())
    install_error_handlers(app)
    for module in (health, models, chat, completions, responses, messages, memory, cache, metrics):
        app.include_router(module.router)
    app.include_router(infill.router)  # llama.cpp's /infill (fill-in-the-middle)
    app.include_router(dashboard.router)  # GET /dashboard: the live page, and its files
    # API key, CORS, body limit, request ids, metrics, time limit, shutdown drain.
    install_production(app, settings, engine)
    # /metrics also serves what /cache/stats and /memory do, so they never disagree.
    app.state.metrics.add_source(
        "expert_cache",
        lambda: cache.metric_numbers(engine),
        "MoE expert cache, as GET /cache/stats",
    )
    app.state.metrics.add_source(
        "prompt_cache",
        lambda: cache.prompt_cache_metric_numbers(engine),
        "Prompt cache (prefix reuse), as the prompt_cache block of GET /cache/stats",
    )
    app.state.metrics.add_source(
        "memory",
        lambda: memory.metric_numbers(engine),
        "Memory and layer residency, as GET /memory",
    )
    app.state.metrics.add_source(
        "distributed",
        lambda: memory.distributed_numbers(engine),
        "Model split across ranks: hidden-state transfer time (total, last step, per step), "
        "rank 0's messages to the other ranks",
    )
    return app
