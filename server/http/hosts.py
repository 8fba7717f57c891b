"""The Host check: a keyless server answers only names it knows (DNS rebinding).

A web page can make the browser send requests to a name the page's owner
controls and then re-point that name at 127.0.0.1 (DNS rebinding). The browser
then treats the local server as the page's own origin, so the page can read
its answers. Nothing but the Host header tells such a request apart: it
carries the attacker's name. Without an API key, the server therefore
answers only when the Host header names
- a loopback name: `localhost`, `*.localhost` (these never resolve elsewhere);
- an IP address, any of them: rebinding needs a DNS name, and a browser sends
  an IP literal only to the address it names, so `--host 0.0.0.0` can still
  be reached as http://192.168.1.20:8000;
- the bind host, when `--host` is a name;
- a name in `allowed_hosts` (`*.example.com` covers subdomains; `*` any name).
With an API key the key protects every route, and the check is off. A request
without a Host header (HTTP/1.0) passes: browsers always send one.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from flashserve.server.http.errors import INVALID_REQUEST, ErrorDetail, error_response

log = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost",)
# Refused names logged (each once) before the server stops logging new ones.
WARN_NAMES = 100


def host_name(host: str) -> str | None:
    """The name part of a Host header value (no port), lowercased, without a final
    dot; IPv6 literals keep their brackets off. None when it cannot be parsed."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        if end < 0 or (host[end + 1 :] and not host[end + 1 :].startswith(":")):
            return None
        return host[1:end]
    name, sep, port = host.rpartition(":")
    if not sep:
        name = port
    elif ":" in name or not port.isdigit():
        return None  # an unbracketed IPv6 address or junk: never a browser's Host
    return name.rstrip(".")


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _matches(name: str, pattern: str) -> bool:
    if pattern == "*":
        return True
    if pattern.startswith("*."):
        return name.endswith(pattern[1:])
    return name == pattern


def normalize_patterns(hosts: Iterable[str]) -> list[str]:
    """allowed_hosts entries as compared: lowercased, no port, no final dot."""
    out = []
    for host in hosts:
        host = host.strip()
        if host == "*" or host.startswith("*."):
            out.append(host.lower().rstrip("."))
        elif host and (name := host_name(host)) is not None:
            out.append(name)
    return out


def host_allowed(host: str, allowed: Iterable[str] = ()) -> bool:
    """Whether a keyless server answers a request with this Host header value."""
    if not host:
        return True
    name = host_name(host)
    if name is None:
        return False
    if is_ip(name) or name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    return any(_matches(name, pattern) for pattern in normalize_patterns(allowed))


class HostCheckMiddleware:
    """400 with an OpenAI error object for a Host header the server does not know."""

    def __init__(self, app: ASGIApp, allowed: list[str]):
        self.app = app
        self.allowed = normalize_patterns(allowed)
        self._warned: set[str] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if host_allowed(host, self.allowed):
            await self.app(scope, receive, send)
            return
        name = (host_name(host) or host)[:100]
        if len(self._warned) < WARN_NAMES and name not in self._warned:
            # Once per name, so a page that keeps trying cannot flood the log;
            # repr: the value is the client's, and the line must stay one line.
            self._warned.add(name)
            log.warning("refused Host %r: not loopback, an IP address or in allowed_hosts", name)
        detail = ErrorDetail(
            message=f"Host {name!r} is not allowed. This server has no API key, so it "
            "answers only loopback names, IP addresses and the names in the setting "
            "allowed_hosts (protection against DNS rebinding). Add the name to allowed_hosts "
            "(--allowed-hosts, FLASHSERVE_ALLOWED_HOSTS) or set an API key.",
            type=INVALID_REQUEST,
            code="host_not_allowed",
        )
        await error_response(400, detail, path=scope["path"])(scope, receive, send)


def bind_host_names(host: str) -> list[str]:
    """The bind host as an allowed name, when it is a name (not an address, not empty)."""
    name = host_name(host)
    return [name] if name and not is_ip(name) else []
