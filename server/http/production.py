"""Wire the production features into an app: API key, Host check, CORS, body limit,
HEAD, request ids and access log, Prometheus /metrics, request time limit and shutdown
drain, and the statuses these answer in the OpenAPI document (server/http/openapi.py).

create_app calls `install_production(app, settings, engines)` once, before the
app starts, and adds the /metrics route and its sources. It leaves on app.state:
- `metrics`: server.http.metrics.Metrics (`add_source()` for more numbers on /metrics)
- `tracker`: server.http.lifecycle.RequestTracker; routes pass it to
  `server.generation.submit(..., tracker=request.app.state.tracker)`
"""

from __future__ import annotations

import ipaddress
import logging

from fastapi import FastAPI
from sse_starlette.sse import AppStatus

from flashserve.server.http.hosts import bind_host_names
from flashserve.server.http.lifecycle import RequestTracker
from flashserve.server.http.metrics import Engines, Metrics
from flashserve.server.http.middleware import install_middleware
from flashserve.server.http.openapi import install_openapi
from flashserve.server.http.security import OPEN_PATHS, resolve_api_key
from flashserve.server.settings import Settings

log = logging.getLogger(__name__)


def install_production(app: FastAPI, settings: Settings, engines: Engines) -> None:
    """`engines()`: every loaded model's engine by name (their counters on /metrics)."""
    api_key = resolve_api_key(settings)
    metrics = Metrics()
    metrics.watch_engines(engines)
    app.state.metrics = metrics
    app.state.tracker = RequestTracker(settings.request_timeout, metrics)
    allowed_hosts = [*settings.allowed_hosts, *bind_host_names(settings.host)]
    install_middleware(
        app,
        metrics=metrics,
        api_key=api_key,
        allowed_origins=settings.allowed_origins,
        allowed_hosts=allowed_hosts,
        max_body_bytes=settings.max_body_bytes,
        log_prompts=settings.log_prompts,
    )
    # /openapi.json lists what the middleware answers on every route (401, 413, ...).
    install_openapi(
        app,
        api_key=api_key is not None,
        host_check=api_key is None and "*" not in allowed_hosts,
        open_paths=OPEN_PATHS,
    )
    # sse-starlette would cut every open stream the moment uvicorn sees SIGTERM,
    # with no final chunk and no [DONE]. The tracker's drain ends streams instead
    # (server/http/lifecycle.py), so turn that off.
    AppStatus.disable_automatic_graceful_drain()
    if api_key is None and is_exposed(settings.host):
        log.warning(
            "listening on %s without an API key: anyone who can reach this port can use "
            "the model. Set --api-key (or FLASHSERVE_API_KEY, api_key_file), or bind 127.0.0.1.",
            settings.host,
        )


def is_exposed(host: str) -> bool:
    """True unless `host` is a loopback address (127.0.0.0/8, ::1, localhost)."""
    if host.strip("[]").lower() in ("localhost", "localhost."):
        return False
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return True  # a host name that may resolve anywhere
