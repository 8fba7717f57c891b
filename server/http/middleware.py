"""ASGI middleware: request ids and access log, body size limit, HEAD, CORS.

Order, outermost first (see install_middleware):
  RequestContext  request id, access log line, metrics, last-resort 500
  HostCheck       keyless servers: 400 for unknown Host names (server/http/hosts.py)
  CORS            preflights answered before auth; error responses get CORS headers
  ApiKey          server/http/security.py
  BodyLimit       413 before the app sees a too-large body
  Head            HEAD answered as GET without the body
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashserve.server.http.errors import (
    INVALID_REQUEST,
    SERVER_ERROR,
    ErrorDetail,
    dialect,
    error_response,
)
from flashserve.server.http.metrics import Metrics

access_log = logging.getLogger("flashserve.access")
prompt_log = logging.getLogger("flashserve.prompts")
log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
# A client-supplied id is echoed only if it is short and printable: it goes into
# log lines, and a newline in it could forge one.
_VALID_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
# --log-prompts logs at most this much of each request body.
PROMPT_LOG_LIMIT = 8192
# Polled every few seconds by probes and scrapers, every second by the dashboard (its
# data routes): their successes log at DEBUG.
QUIET_PATHS = frozenset({"/health", "/metrics", "/memory", "/cache/stats"})
# Status logged when the client went away before any response (nginx's convention).
CLIENT_CLOSED = 499

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "flashserve_request_id", default=None
)


def current_request_id() -> str | None:
    """The id of the request being served by this task (None outside a request)."""
    return request_id_var.get()


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == REQUEST_ID_HEADER.encode():
            text = value.decode("latin-1")
            if _VALID_ID.match(text):
                return text
            break
    return uuid.uuid4().hex


class RequestContextMiddleware:
    """X-Request-ID in and out, one access log line per request, HTTP metrics.

    The access line carries method, path (no query string), status, duration and
    the request id; request bodies are never logged unless `log_prompts`.
    """

    def __init__(
        self,
        app: ASGIApp,
        metrics: Metrics | None = None,
        log_prompts: bool = False,
        routes_app: FastAPI | None = None,
    ):
        self.app = app
        self.metrics = metrics
        self.log_prompts = log_prompts
        self.routes_app = routes_app
        self._templates: list[tuple[re.Pattern[str], str]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_from(scope["headers"])
        scope.setdefault("state", {})["request_id"] = rid
        token = request_id_var.set(rid)
        started = time.perf_counter()
        status = 0
        body_seen: list[bytes] = []
        anthropic = dialect(scope["path"]) == "anthropic"

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [h for h in message.get("headers", []) if h[0] != b"x-request-id"]
                headers.append((b"x-request-id", rid.encode("latin-1")))
                if anthropic:  # where Anthropic's SDKs read it (APIStatusError.request_id)
                    headers.append((b"request-id", rid.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        async def receive_logged() -> Message:
            message = await receive()
            if message["type"] == "http.request" and sum(map(len, body_seen)) < PROMPT_LOG_LIMIT:
                body_seen.append(message.get("body", b""))
            return message

        try:
            await self.app(scope, receive_logged if self.log_prompts else receive, send_with_id)
        except Exception:
            log.exception(
                "unhandled error in %s %s (request %s)", scope["method"], scope["path"], rid
            )
            if status == 0:
                status = 500
                detail = ErrorDetail(
                    message=f"Internal server error (request id {rid}).",
                    type=SERVER_ERROR,
                    code="internal_error",
                )
                response = error_response(500, detail, path=scope["path"])
                await response(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - started
            status = status or CLIENT_CLOSED
            if self.log_prompts and body_seen:
                body = b"".join(body_seen)[:PROMPT_LOG_LIMIT].decode("utf-8", "replace")
                prompt_log.info("request %s body: %s", rid, body)
            client = scope.get("client")
            quiet = scope["path"] in QUIET_PATHS and status < 400
            access_log.log(
                logging.DEBUG if quiet else logging.INFO,
                '%s "%s %s" %d %.1fms id=%s',
                f"{client[0]}:{client[1]}" if client else "-",
                scope["method"],
                # The raw (still percent-encoded) path: a decoded %0A could forge a log line.
                scope.get("raw_path", scope["path"].encode()).decode("latin-1"),
                status,
                seconds * 1000,
                rid,
            )
            if self.metrics is not None:
                route = self._route_label(scope)
                self.metrics.observe_request(route, scope["method"], status, seconds)
            request_id_var.reset(token)

    def _route_label(self, scope: Scope) -> str:
        """The route template (/v1/chat/completions), never the raw path: raw paths of
        404s would give every scanner probe its own time series."""
        route = scope.get("route")
        if route is not None and getattr(route, "path", None):
            return route.path
        # Rejected before routing (401, 413): match the path against the app's routes.
        if self._templates is None:
            self._templates = route_templates(self.routes_app) if self.routes_app else []
        for regex, template in self._templates:
            if regex.match(scope["path"]):
                return template
        return "other"


def route_templates(app: FastAPI) -> list[tuple[re.Pattern[str], str]]:
    """(path regex, path template) of every route of `app`, included routers too."""
    found: list[tuple[re.Pattern[str], str]] = []

    def walk(routes: Any) -> None:
        for route in routes:
            path, regex = getattr(route, "path", None), getattr(route, "path_regex", None)
            if path and regex is not None:
                found.append((regex, path))
            # FastAPI >= 0.16x keeps included routers as wrappers with route contexts.
            contexts = getattr(route, "effective_route_contexts", None)
            if callable(contexts):
                for context in contexts():
                    if getattr(context, "path_regex", None) is not None:
                        found.append((context.path_regex, context.path))
            if getattr(route, "routes", None) and not path:
                walk(route.routes)

    walk(app.router.routes)
    return found


class BodyLimitMiddleware:
    """413 for bodies over `max_bytes`, counted on the bytes actually received.

    A declared Content-Length over the limit is refused before anything is read.
    Otherwise the body is read here, up to the limit, and replayed to the app:
    the headers cannot be trusted for the count. With both `Transfer-Encoding:
    chunked` and a small `Content-Length`, the HTTP parser follows the chunks
    (RFC 9112) and would hand the app a body of any size.
    """

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1  # the HTTP server rejects a malformed length itself
            if declared > self.max_bytes:
                await self._reject(scope, receive, send)
                return
        # Every route reads its whole body anyway: buffering it first costs one copy.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: http.disconnect, for streams

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        detail = ErrorDetail(
            message=f"Request body too large: the limit is {self.max_bytes} bytes "
            "(setting max_body_bytes).",
            type=INVALID_REQUEST,
            code="request_too_large",
        )
        # Connection: close, since the rest of the body is left unread on the socket.
        response = error_response(413, detail, {"Connection": "close"}, path=scope["path"])
        await response(scope, receive, send)


class HeadMiddleware:
    """HEAD answered as GET, without the body. FastAPI routes list only GET, so
    HEAD /health was 405; monitors and `curl -I` ask with HEAD."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        # The headers stay those of GET, Content-Length included (RFC 9110, 9.3.2).
        await self.app({**scope, "method": "GET"}, receive, send_headers_only)


def install_middleware(
    app: FastAPI,
    *,
    metrics: Metrics | None,
    api_key: str | None,
    allowed_origins: list[str],
    allowed_hosts: list[str],
    max_body_bytes: int,
    log_prompts: bool,
) -> None:
    """Add the middleware stack to `app` (before it starts). add_middleware puts each
    new layer outside the previous ones, so this adds innermost first.

    `allowed_hosts`: the Host check's extra names (server/http/hosts.py); the check
    applies only without an API key, and "*" turns it off."""
    from flashserve.server.http.hosts import HostCheckMiddleware
    from flashserve.server.http.security import ApiKeyMiddleware

    app.add_middleware(HeadMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if allowed_origins:
        kwargs: dict[str, Any] = {
            "allow_origins": allowed_origins,
            "allow_methods": ["GET", "POST", "OPTIONS"],
            # Browser SDKs send extra headers (openai-js: x-stainless-*; Anthropic's:
            # x-api-key, anthropic-version, anthropic-beta); keys in headers, not
            # cookies, so no credentials.
            "allow_headers": ["*"],
            "expose_headers": ["X-Request-ID", "Retry-After"],
            "allow_credentials": False,
            "max_age": 600,
        }
        app.add_middleware(CORSMiddleware, **kwargs)
    if api_key is None and "*" not in allowed_hosts:
        # Outside CORS: a rebinding page is its own origin and needs no preflight.
        app.add_middleware(HostCheckMiddleware, allowed=allowed_hosts)
    app.add_middleware(
        RequestContextMiddleware, metrics=metrics, log_prompts=log_prompts, routes_app=app
    )
