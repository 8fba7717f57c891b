"""GET /dashboard: a live page of what happens out of sight (issue 20).

The page is static package data (server/dashboard/: index.html, app.js,
style.css, and uPlot 1.6.32 from npm, MIT, with its LICENSE): no build step,
nothing loaded from outside the machine. Its script polls the data routes the server already
has (/health, /memory, /cache/stats, /metrics) once a second at most, and
stops while the tab is hidden.

The page and its files hold no data, so they are served without the API key
(security.DASHBOARD_PATHS): a browser loads them before the page can ask for
the key. The data routes keep their key check; the page asks for the key once
and keeps it in the tab's sessionStorage. The Host check and CORS apply as to
every route; the page is same-origin. Its Content-Security-Policy allows
scripts, styles and requests from this origin only, and no inline script.

GET /dashboard/info (keyed, like every data route) is the one route the page
adds: the version and the settings that matter, read once when it opens. The
per-layer read bytes of its layer strip are in /memory (`layer_bytes_read`).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field

from flashserve.engine.compute import blas
from flashserve.server.http.deps import ReadyModel, SettingsDep
from flashserve.server.http.errors import error_responses
from flashserve.server.settings import Settings

router = APIRouter(tags=["dashboard"])

PAGE = "/dashboard"
# The page's files: URL name -> media type. The page links exactly these.
FILES = {
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
}

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Small files: revalidate every time, so an upgraded server never mixes versions.
    "Cache-Control": "no-cache",
}


class DashboardSettings(BaseModel):
    """The settings behind what the dashboard shows (server/settings.py has them all)."""

    residency: str = Field(description="all, fixed or auto: which decoder layers stay resident")
    resident_layers: int | None = Field(description="fixed: that many layers resident")
    memory_budget: int | None = Field(description="bytes for resident weights, if set")
    placement: str = Field(description="which layers stay: first_n, last_n or interleaved")
    prefetch_depth: int = Field(description="streamed layers read ahead of the one running")
    expert_cache: str | None = Field(description="expert cache size: slots or bytes; null: off")
    expert_policy: str
    expert_prefetch: str
    max_batch: int
    max_queue: int
    prompt_cache_bytes: int
    prompt_cache_disk_bytes: int

    @classmethod
    def from_settings(cls, settings: Settings) -> DashboardSettings:
        return cls(**{name: getattr(settings, name) for name in cls.model_fields})


class DashboardInfo(BaseModel):
    version: str = Field(description="flashserve's version")
    model: str = Field(description="the served model's id")
    context_length: int
    blas: str = Field(description="what serves float matmuls: mkl, reference or accelerate")
    settings: DashboardSettings


@cache
def asset(name: str) -> bytes:
    """A file of the page, read once from the package (editable or installed alike)."""
    return resources.files("flashserve.server").joinpath("dashboard", name).read_bytes()


@router.get(PAGE, include_in_schema=False)
async def page() -> Response:
    return Response(asset("index.html"), media_type="text/html; charset=utf-8", headers=HEADERS)


def _file_route(name: str, media_type: str) -> None:
    async def serve_file() -> Response:
        return Response(asset(name), media_type=media_type, headers=HEADERS)

    router.add_api_route(f"{PAGE}/{name}", serve_file, methods=["GET"], include_in_schema=False)


for _name, _media_type in FILES.items():
    _file_route(_name, _media_type)


@router.get(f"{PAGE}/info", response_model=DashboardInfo, responses=error_responses(503))
async def dashboard_info(
    request: Request, loaded: ReadyModel, settings: SettingsDep
) -> DashboardInfo:
    """The version, the model and the settings that shape what the dashboard shows."""
    return DashboardInfo(
        version=request.app.version,
        model=loaded.model_id,
        context_length=loaded.context_length,
        blas=blas.describe(),
        settings=DashboardSettings.from_settings(settings),
    )
