"""GET /health: 200 once the model is loaded, 503 while it loads or after it failed
(several models: the default's state; with none named at start, 200 and each model's).
GET / (and HEAD /): what this server is, always 200.

The health body also says whether the worker is busy, so a client (or a test)
can see a cancelled generation free the worker. Clients probe `/` before their
first request (Claude Code's HEAD / warm-up): a 404 there reads as "no server".
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from flashserve.engine.compute import blas
from flashserve.server.http.deps import PoolDep
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
    # Several models: each one's state (the fields above are the default's, or the
    # most recently used one's; none loaded yet is still "ok": they load on demand).
    models: list[dict[str, Any]] | None = None


class About(BaseModel):
    name: Literal["flashserve"] = "flashserve"
    description: str = (
        "OpenAI- and Anthropic-compatible server for language models larger than memory"
    )
    version: str
    status: Literal["ok", "loading", "failed", "stopped"]
    model: str | None = None
    endpoints: list[str] = [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/models",
        "/health",
        "/metrics",
        "/dashboard",
    ]


@router.get("/", response_model=About, response_model_exclude_none=True)
async def about(request: Request, pool: PoolDep) -> About:
    slot = pool.current_slot()
    engine = slot.engine if slot is not None else None
    if engine is None:
        return About(version=request.app.version, status="ok")
    loaded = engine.loaded if engine.state == "ready" else None
    return About(
        version=request.app.version,
        status="ok" if loaded is not None else engine.state,  # type: ignore[arg-type]
        model=loaded.model_id if loaded is not None else None,
    )


@router.get(
    "/health",
    response_model=Health,
    response_model_exclude_none=True,
    responses={503: {"model": Health}},
)
async def health(pool: PoolDep) -> Health | JSONResponse:
    slot = pool.current_slot()
    engine = slot.engine if slot is not None else None
    models = pool.describe() if len(pool.slots) > 1 else None
    if engine is None:
        return Health(status="ok", models=models, blas=blas.describe())
    if engine.state == "ready" and engine.loaded is not None:
        stats = engine.stats_dict()
        return Health(
            status="ok",
            model=engine.loaded.model_id,
            busy=not engine.idle,
            queued=stats.get("queued", 0),
            stats=stats,
            blas=blas.describe(),
            models=models,
        )
    error = not_ready(engine.state, engine.load_error)
    body = Health(status=engine.state, error=error.detail, models=models)  # type: ignore[arg-type]
    return JSONResponse(body.model_dump(exclude_none=True), status_code=503, headers=error.headers)
