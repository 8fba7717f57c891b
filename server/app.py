"""The FastAPI application: shared state, error handlers, one router per resource.

The models' pool (engine/models/pool.py) starts with the app: the --model's
worker thread loads it (so /health answers 503 while it loads); other models
load on their first request. Every worker stops with the app.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from flashserve.engine.generation.worker import Engine
from flashserve.engine.models.pool import ModelPool
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
    """The app over the settings' models. `engine`: the --model's, made by the caller
    (serve waits on it to exit 2 when it fails to load); made here when not given."""
    entries, default = settings.model_entries()
    pool = ModelPool(
        entries, default, max_loaded=settings.models_max, idle_unload=settings.idle_unload
    )
    if default is not None:
        pool.adopt(
            default, engine if engine is not None else Engine(pool.slots[default].entry.config)
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool.start()
        try:
            yield
        finally:
            # Joining the workers blocks; keep it off the event loop.
            await asyncio.to_thread(pool.stop)

    app = FastAPI(title="flashserve", version=VERSION, lifespan=lifespan)
    app.state.settings = settings
    app.state.pool = pool
    # The --model's engine (None with models_dir alone), for callers embedding the app.
    app.state.engine = pool.slots[default].engine if default is not None else None
    app.state.started_at = int(time.time())
    install_error_handlers(app)
    for module in (health, models, chat, completions, responses, messages, memory, cache, metrics):
        app.include_router(module.router)
    app.include_router(infill.router)  # llama.cpp's /infill (fill-in-the-middle)
    app.include_router(dashboard.router)  # GET /dashboard: the live page, and its files
    # API key, CORS, body limit, request ids, metrics, time limit, shutdown drain.
    install_production(app, settings, pool.engines)
    # /metrics also serves what /cache/stats and /memory do, so they never disagree:
    # per loaded model, each sample labelled with its model.
    app.state.metrics.add_model_source(
        "expert_cache",
        pool.engines,
        cache.metric_numbers,
        "MoE expert cache, as GET /cache/stats",
    )
    app.state.metrics.add_model_source(
        "prompt_cache",
        pool.engines,
        cache.prompt_cache_metric_numbers,
        "Prompt cache (prefix reuse), as the prompt_cache block of GET /cache/stats",
    )
    app.state.metrics.add_model_source(
        "memory",
        pool.engines,
        memory.metric_numbers,
        "Memory and layer residency, as GET /memory",
    )
    app.state.metrics.add_model_source(
        "distributed",
        pool.engines,
        memory.distributed_numbers,
        "Model split across ranks: hidden-state transfer time (total, last step, per step), "
        "rank 0's messages to the other ranks",
    )
    app.state.metrics.add_source("models", pool.numbers, "Models: loaded, loads, unloads")
    return app
