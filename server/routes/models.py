"""GET /v1/models and GET /v1/models/{id}: the one served model."""

from __future__ import annotations

from fastapi import APIRouter, Request

from flashserve.engine.weights.model import LoadedModel
from flashserve.server.http.deps import ReadyModel, SettingsDep, check_model
from flashserve.server.http.errors import error_responses
from flashserve.server.openai.protocol import ModelCard, ModelList

router = APIRouter(tags=["models"])


def _card(request: Request, loaded: LoadedModel) -> ModelCard:
    return ModelCard(
        id=loaded.model_id,
        created=request.app.state.started_at,
        context_length=loaded.context_length,
        model_context_length=loaded.model_context_length,
    )


@router.get("/v1/models", response_model=ModelList, responses=error_responses(503))
async def list_models(request: Request, loaded: ReadyModel) -> ModelList:
    return ModelList(data=[_card(request, loaded)])


@router.get(
    "/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses(404, 503)
)
async def get_model(
    model_id: str,
    request: Request,
    loaded: ReadyModel,
    settings: SettingsDep,
) -> ModelCard:
    check_model(model_id, loaded, settings)
    return _card(request, loaded)
