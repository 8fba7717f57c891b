"""GET /health: 200 once the model is loaded, 503 while it loads or after it failed.

The body also says whether the worker is busy, so a client (or a test) can see
a cancelled generation free the worker.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from engine import blas
from engine.worker import Engine

from ..deps import get_engine
from ..errors import not_ready
from ..schemas import Health

router = APIRouter(tags=["health"])


@router.get(
    "/health",
    response_model=Health,
    response_model_exclude_none=True,
    responses={503: {"model": Health}},
)
async def health(engine: Engine = Depends(get_engine)) -> Health | JSONResponse:
    if engine.state == "ready" and engine.loaded is not None:
        stats = engine.stats_dict()
        return Health(
            status="ok",
            model=engine.loaded.model_id,
            busy=not engine.idle,
            queued=stats.get("queued", 0),
            stats=stats,
            blas=blas.describe(),
        )
    error = not_ready(engine.state, engine.load_error)
    body = Health(status=engine.state, error=error.detail)  # type: ignore[arg-type]
    return JSONResponse(body.model_dump(exclude_none=True), status_code=503, headers=error.headers)
