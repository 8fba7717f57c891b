"""API key authentication.

When a key is configured (`--api-key`, `api_key_file`, or FLASHSERVE_API_KEY),
every route except the open ones needs `Authorization: Bearer <key>` or
`x-api-key: <key>` (how the Anthropic SDKs and Claude Code send it; either
header on any route, so one client configuration works everywhere). This is a
pure ASGI middleware rather than a per-route dependency so that routes added
later (/cache/stats, /memory, ...) are protected by default: forgetting to
protect a new route must not open it.
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from flashserve.server.http.errors import INVALID_REQUEST, ErrorDetail, error_response
from flashserve.server.settings import Settings, SettingsError

log = logging.getLogger(__name__)

# The dashboard's page and its files (server/routes/dashboard.py) hold no data, and a
# browser loads them before the page can ask for the key. Exact paths: nothing else
# under /dashboard (its /dashboard/info included) is open.
DASHBOARD_PATHS = frozenset(
    {
        "/dashboard",
        "/dashboard/app.js",
        "/dashboard/style.css",
        "/dashboard/uPlot.iife.min.js",
        "/dashboard/uPlot.min.css",
    }
)
# Liveness probes (load balancers, systemd, container healthchecks) carry no key;
# nor does a client's probe of / (what server is this).
OPEN_PATHS = frozenset({"/", "/health"}) | DASHBOARD_PATHS


def resolve_api_key(settings: Settings) -> str | None:
    """The configured key: `api_key` (flag or FLASHSERVE_API_KEY) wins over `api_key_file`."""
    if settings.api_key:
        return settings.api_key.strip() or None
    if not settings.api_key_file:
        return None
    path = Path(settings.api_key_file).expanduser()
    try:
        key = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"setting 'api_key_file': cannot read {path}: {exc}") from None
    if not key:
        # An operator who points at a key file means to require a key: an empty
        # file must not silently leave the server open.
        raise SettingsError(f"setting 'api_key_file': {path} is empty")
    return key


def bearer_token(header: bytes | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    token = token.strip()
    return token or None


def key_matches(presented: bytes | None, expected: bytes) -> bool:
    """Constant-time comparison, so response timing does not leak the key."""
    if presented is None:
        return False
    return hmac.compare_digest(presented, expected)


class ApiKeyMiddleware:
    """401 with an error object (the path's dialect) unless the request carries the key."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS):
        self.app = app
        self._key = api_key.encode("utf-8")
        self._open = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        token = bearer_token(headers.get(b"authorization"))
        x_api_key = headers.get(b"x-api-key", b"").strip() or None
        if key_matches(token, self._key) or key_matches(x_api_key, self._key):
            await self.app(scope, receive, send)
            return
        if token is None and x_api_key is None:
            message = (
                "You didn't provide an API key. Send it in the Authorization header "
                "('Authorization: Bearer YOUR_KEY') or the x-api-key header."
            )
            code = None
        else:
            # Never echo the presented key: it may be a real secret sent to the wrong server.
            message = "Incorrect API key provided."
            code = "invalid_api_key"
        response = error_response(
            401,
            ErrorDetail(message=message, type=INVALID_REQUEST, code=code),
            {"WWW-Authenticate": "Bearer"},
            path=scope["path"],
        )
        await response(scope, receive, send)
