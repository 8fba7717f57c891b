"""Open connections: bounded, idle ones closed, enough file descriptors for them.

uvicorn keeps every connection until its client closes it. A connection that
never sends a request is never timed out, and the listening socket accepts
until the process runs out of file descriptors (EMFILE). Then no new
connection is served, /health included. Here:
- a new connection that sends nothing for `keep_alive_timeout` is closed, like
  an idle keep-alive connection;
- at most `max_connections` are open. Past that, the connection idle the
  longest is closed to make room. When every connection is serving a request,
  the new one's request gets 503 (uvicorn's limit_concurrency);
- the listen backlog is small (ACCEPT_BACKLOG): asyncio accepts up to `backlog`
  connections in one go, before any of them can be closed, so uvicorn's 2048
  could exhaust a 2048 open-file limit in one burst of connects;
- the soft open-file limit is raised to fit `max_connections` and the server's
  own files.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

log = logging.getLogger(__name__)

# The listen queue, and the most connections asyncio accepts per wake-up. A burst
# is closed (past max_connections) a few loop turns after it is accepted, so a few
# bursts can be open at once; clients beyond the queue retry their SYN, unharmed.
ACCEPT_BACKLOG = 128
# File descriptors the server needs besides connections: model, layer and expert
# files, prompt-cache files, the pread pool, pipes, and accept bursts not yet closed.
FD_HEADROOM = 1024
# Seconds between two warnings that the connection limit was reached.
WARN_EVERY_S = 60.0


def bounded_protocol(max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (h11 or httptools, as uvicorn picks), with idle
    connections timed out from the start and at most `max_connections` open."""
    last_warning = [-WARN_EVERY_S]

    class BoundedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        idle_since = 0.0

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.idle_since = time.monotonic()
            # uvicorn starts this timer only after a response; a client that sends
            # nothing would hold its connection forever.
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            if len(self.connections) > max_connections:
                self._make_room()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.idle_since = time.monotonic()

        def _make_room(self) -> None:
            live = [c for c in self.connections if not c.transport.is_closing()]
            excess = len(live) - max_connections
            if excess <= 0:
                return
            idle = (c for c in live if c is not self and _idle(c))
            closed = 0
            for conn in heapq.nsmallest(excess, idle, key=lambda c: c.idle_since):
                conn.timeout_keep_alive_handler()  # closes it, as its keep-alive time would
                closed += 1
            now = time.monotonic()
            if now - last_warning[0] >= WARN_EVERY_S:
                last_warning[0] = now
                log.warning(
                    "max_connections (%d) reached: closing the longest idle connections%s",
                    max_connections,
                    "" if closed == excess else "; none idle, new requests get 503",
                )

    return BoundedHTTPProtocol


def _idle(conn: Any) -> bool:
    """No request being served: none yet (or headers still coming), or answered."""
    cycle = getattr(conn, "cycle", None)
    return cycle is None or cycle.response_complete


def fit_open_file_limit(max_connections: int) -> int:
    """Raise the soft open-file limit to max_connections + FD_HEADROOM (at most the
    hard limit) and return the max_connections that fits under it.

    Call it after mlx_lm is imported: importing mlx_lm.utils sets the limits to
    (2048, 4096) for model files, hard limit included.
    """
    try:
        import resource
    except ImportError:  # not POSIX
        return max_connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + FD_HEADROOM
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            log.debug("open-file limit raised from %d to %d", soft, wanted)
            soft = wanted
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, wanted, exc)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    fits = max(soft - FD_HEADROOM, soft // 2)
    if fits < max_connections:
        log.warning(
            "max_connections %d lowered to %d: the open-file limit is %d. Raise it "
            "(ulimit -n, systemd LimitNOFILE=) or lower max_connections.",
            max_connections,
            fits,
            soft,
        )
        return fits
    return max_connections
