"""GET /v1/models and GET /v1/models/{id}: the one served model."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from engine.loader import LoadedModel

from ..deps import check_model, get_settings, ready_model
from ..schemas import ModelCard, ModelList
from ..settings import Settings

router = APIRouter(tags=["models"])


def _card(request: Request, loaded: LoadedModel) -> ModelCard:
    return ModelCard(
        id=loaded.model_id,
        created=request.app.state.started_at,
        context_length=loaded.context_length,
    )


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request, loaded: LoadedModel = Depends(ready_model)) -> ModelList:
    return ModelList(data=[_card(request, loaded)])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def get_model(
    model_id: str,
    request: Request,
    loaded: LoadedModel = Depends(ready_model),
    settings: Settings = Depends(get_settings),
) -> ModelCard:
    check_model(model_id, loaded, settings)
    return _card(request, loaded)
