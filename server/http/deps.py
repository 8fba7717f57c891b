"""FastAPI dependencies for the state the app shares: the models' pool, settings, an
engine and its loaded model.

Routes take them in the `Annotated` form (`engine: EngineDep`); a route whose
body names a model takes its engine with `async with serving(request, body.model)`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, Request

from flashserve.engine.generation.requests import LogitsProcessor
from flashserve.engine.generation.worker import Engine
from flashserve.engine.models.pool import ModelPool, ModelUnavailableError, UnknownModelError
from flashserve.engine.weights.model import LoadedModel
from flashserve.server.http.errors import model_not_found, model_unavailable, not_ready
from flashserve.server.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_pool(request: Request) -> ModelPool:
    return request.app.state.pool


def get_engine(request: Request) -> Engine:
    """The engine of the routes that name no model (/health, /memory, /cache/stats,
    the dashboard; `?model=` picks another on the last three): the --model's, else
    the most recently used loaded model's; 503 when no model is loaded."""
    pool: ModelPool = request.app.state.pool
    name = request.query_params.get("model")
    try:
        slot = pool.resolve(name) if name else pool.current_slot()
    except UnknownModelError:
        raise model_not_found(name or "") from None
    if slot is None or slot.engine is None:
        what = f"model {name}" if name else "no model"
        raise not_ready("not loaded", f"{what} is loaded yet; models load on their first request")
    return slot.engine


EngineDep = Annotated[Engine, Depends(get_engine)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
PoolDep = Annotated[ModelPool, Depends(get_pool)]


def ready_model(engine: EngineDep) -> LoadedModel:
    """The loaded model, or 503 while it loads (or when loading failed)."""
    if engine.state != "ready" or engine.loaded is None:
        raise not_ready(engine.state, engine.load_error)
    return engine.loaded


ReadyModel = Annotated[LoadedModel, Depends(ready_model)]


@asynccontextmanager
async def serving(request: Request, name: str | None) -> AsyncIterator[tuple[Engine, LoadedModel]]:
    """The engine and model a request names (id or alias; none: the default), loaded
    first if it is not (a request waits for the load, up to request_timeout). While
    held, the model is not unloaded: hold it until the request is submitted.
    404 for an unknown model, 503 while the --model loads at start or when a load
    fails, in the route's dialect."""
    pool: ModelPool = request.app.state.pool
    settings: Settings = request.app.state.settings
    try:
        async with pool.lease(name, timeout=settings.request_timeout) as engine:
            if engine.state != "ready" or engine.loaded is None:
                raise not_ready(engine.state, engine.load_error)
            yield engine, engine.loaded
    except UnknownModelError:
        raise model_not_found(name or "") from None
    except ModelUnavailableError as exc:
        raise model_unavailable(str(exc), transient=exc.transient) from None


def request_logits_processors() -> list[LogitsProcessor]:
    """Logits processors a caller embedding the app adds to every chat request.

    None here. An embedding application (or a test that scripts a tiny
    model's output) supplies them with `app.dependency_overrides`.
    """
    return []


ExtraProcessors = Annotated[list[LogitsProcessor], Depends(request_logits_processors)]


def vocab_size(loaded: LoadedModel) -> int:
    """Size of the model's output layer (token ids a logit_bias may name)."""
    config = loaded.config or {}
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if size else len(loaded.tokenizer)
