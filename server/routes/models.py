"""GET /v1/models and GET /v1/models/{id}: every model the server serves, and its state."""

from __future__ import annotations

from fastapi import APIRouter, Request

from flashserve.engine.models.pool import ModelPool, Slot, UnknownModelError
from flashserve.server.http.deps import PoolDep
from flashserve.server.http.errors import error_responses, model_not_found, not_ready
from flashserve.server.openai.protocol import ModelCard, ModelList

router = APIRouter(tags=["models"])


def _card(request: Request, slot: Slot, about: dict) -> ModelCard:
    engine = slot.engine
    loaded = engine.loaded if engine is not None and engine.state == "ready" else None
    return ModelCard(
        id=slot.entry.name,
        created=request.app.state.started_at,
        context_length=loaded.context_length if loaded is not None else None,
        model_context_length=loaded.model_context_length if loaded is not None else None,
        state=about["state"],
        aliases=about["aliases"],
        size_bytes=about["size_bytes"] or None,
        memory_bytes=about["memory_bytes"],
        load_seconds=about["load_seconds"],
        error=about["error"],
    )


def _check_default(pool: ModelPool) -> None:
    """A one-model server answers 503 while its model loads (or failed), as always."""
    if len(pool.slots) == 1 and pool.default is not None:
        engine = pool.slots[pool.default].engine
        if engine is not None and engine.state != "ready":
            raise not_ready(engine.state, engine.load_error)


@router.get("/v1/models", response_model=ModelList, responses=error_responses(503))
async def list_models(request: Request, pool: PoolDep) -> ModelList:
    _check_default(pool)
    about = {a["id"]: a for a in pool.describe()}
    return ModelList(data=[_card(request, s, about[n]) for n, s in pool.slots.items()])


@router.get(
    "/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses(404, 503)
)
async def get_model(model_id: str, request: Request, pool: PoolDep) -> ModelCard:
    _check_default(pool)
    try:
        slot = pool.resolve(model_id)
    except UnknownModelError:
        raise model_not_found(model_id) from None
    about = {a["id"]: a for a in pool.describe()}
    return _card(request, slot, about[slot.entry.name])
