"""GET /health: 200 once the model is loaded, 503 while it loads or after it failed.

The body also says whether the worker is busy, so a client (or a test) can see
a cancelled generation free the worker.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from flashserve.engine.compute import blas
from flashserve.server.http.deps import EngineDep
from flashserve.server.http.errors import ErrorDetail, not_ready

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: Literal["ok", "loading", "failed", "stopped"]
    model: str | None = None
    busy: bool = False  # a generation is running or waiting
    queued: int = 0
    stats: dict[str, Any] | None = None  # engine.stats_dict() when loaded
    blas: str | None = None  # what serves float matmuls: mkl, reference or accelerate
    error: ErrorDetail | None = None  # set when status is not ok (503)


@router.get(
    "/health",
    response_model=Health,
    response_model_exclude_none=True,
    responses={503: {"model": Health}},
)
async def health(engine: EngineDep) -> Health | JSONResponse:
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
