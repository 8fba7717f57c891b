"""Request lifetimes: per-request time limit, graceful shutdown, latency metrics.

Every generation the server submits goes through `RequestTracker.track()`,
which returns a `TrackedHandle`: the engine's RequestHandle plus
- a deadline (`request_timeout`): past it the generation is cancelled;
- shutdown: on SIGTERM running generations get `shutdown_grace` seconds to
  finish, then are cancelled;
- time-to-first-token and inter-token latency observations.

A generation cut by the time limit or by shutdown ends like one that reached
max_tokens: its last event is a DoneEvent with finish_reason "length" (for a
stream: a final chunk with that finish_reason, then [DONE]). "length" is the
OpenAI value that means "the answer was cut short"; a made-up value would
break clients that validate finish_reason. The cause is logged with the
request id and counted in flashserve_generations_total{reason}.

SIGTERM: uvicorn stops accepting connections and then waits for open ones to
finish; lifespan shutdown only runs after that, too late to end streams.
`GracefulServer.shutdown` therefore starts the drain itself, alongside
uvicorn's wait.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from flashserve.engine.generation.requests import (
    DoneEvent,
    ErrorEvent,
    Event,
    PromptLogprobsEvent,
    RequestHandle,
    TokenEvent,
)
from flashserve.server.http.metrics import Metrics
from flashserve.server.http.middleware import current_request_id

log = logging.getLogger(__name__)

# Causes for which the server (not the client) cut a generation short.
SERVER_CANCEL_REASONS = ("timeout", "shutdown")
# Extra seconds uvicorn waits after the grace period for the final events to be written.
FLUSH_MARGIN_S = 5.0


class TrackedHandle:
    """A RequestHandle with a deadline; same interface for the routes."""

    def __init__(self, handle: RequestHandle, tracker: RequestTracker, timeout: float):
        self._handle = handle
        self._tracker = tracker
        self.request = handle.request
        self.cancel_reason: str | None = None
        self.submitted_at = time.monotonic()
        self._timer = asyncio.get_running_loop().call_later(timeout, self._expire, timeout)

    @property
    def cancelled(self) -> bool:
        return self._handle.cancelled

    async def wait_admitted(self, timeout: float | None) -> int | None:
        return await self._handle.wait_admitted(timeout)

    def cancel(self, reason: str | None = None) -> None:
        """Stop the generation. `reason` None: the client went away (nobody listens)."""
        if self.cancel_reason is None:
            self.cancel_reason = reason or "cancelled"
        self._handle.cancel()
        if reason is None:
            self._finish()

    def _expire(self, timeout: float) -> None:
        # call_later runs this in the context of the request: its X-Request-ID is known.
        log.warning(
            "request %s (id=%s) reached the time limit (request_timeout=%gs); cancelling it",
            self.request.request_id,
            current_request_id(),
            timeout,
        )
        self.cancel("timeout")

    def _finish(self) -> None:
        self._timer.cancel()
        self._tracker._discard(self)

    async def events(self) -> AsyncIterator[Event]:
        metrics = self._tracker.metrics
        tokens = 0
        last = self.submitted_at
        try:
            async for event in self._handle.events():
                now = time.monotonic()
                if isinstance(event, TokenEvent):
                    if metrics is not None:
                        (metrics.ttft if tokens == 0 else metrics.itl).observe(now - last)
                    tokens += 1
                    last = now
                    yield event
                    continue
                if isinstance(event, PromptLogprobsEvent):
                    yield event
                    continue
                yield self._final(event, tokens)
        finally:
            self._finish()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self.events()

    def _final(self, event: Event, tokens: int) -> Event:
        reason = "error" if isinstance(event, ErrorEvent) else getattr(event, "finish_reason", "")
        if (
            isinstance(event, DoneEvent)
            and event.finish_reason == "cancelled"
            and self.cancel_reason in SERVER_CANCEL_REASONS
        ):
            reason = self.cancel_reason
            log.info(
                "request %s (id=%s) ended by %s after %d tokens (finish_reason=length)",
                self.request.request_id,
                current_request_id(),
                reason,
                tokens,
            )
            # Cut, not cancelled: the client gets what was generated, as with max_tokens.
            event = dataclasses.replace(event, finish_reason="length")
        if self._tracker.metrics is not None:
            self._tracker.metrics.generations.labels(reason or "unknown").inc()
        return event


class RequestTracker:
    """The generations in flight, for time limits, metrics and shutdown."""

    def __init__(self, request_timeout: float, metrics: Metrics | None = None):
        self.request_timeout = request_timeout
        self.metrics = metrics
        self.draining = False
        self._live: set[TrackedHandle] = set()
        if metrics is not None:
            metrics.in_flight.set_function(lambda: len(self._live))

    @property
    def live(self) -> int:
        return len(self._live)

    def track(self, handle: RequestHandle) -> TrackedHandle:
        """Call on the event loop right after `engine.submit()`."""
        tracked = TrackedHandle(handle, self, self.request_timeout)
        self._live.add(tracked)
        return tracked

    def _discard(self, tracked: TrackedHandle) -> None:
        self._live.discard(tracked)

    def cancel_all(self, reason: str) -> int:
        live = list(self._live)
        for tracked in live:
            tracked.cancel(reason)
        return len(live)

    async def drain(self, grace: float) -> None:
        """Let generations finish for up to `grace` seconds, then cancel the rest."""
        self.draining = True
        deadline = time.monotonic() + grace
        if self._live:
            log.info("waiting up to %gs for %d generation(s) to finish", grace, len(self._live))
        while self._live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._live:
            count = self.cancel_all("shutdown")
            log.warning("shutdown grace of %gs over: cancelled %d generation(s)", grace, count)


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains generations when it shuts down."""

    def __init__(self, config: uvicorn.Config, tracker: RequestTracker | None, grace: float):
        super().__init__(config)
        self.tracker = tracker
        self.grace = grace

    async def shutdown(self, sockets: Any = None) -> None:
        if self.tracker is None:
            await super().shutdown(sockets)
            return
        # uvicorn first stops accepting, then waits for open connections; the drain
        # runs alongside and ends the generations those connections are waiting on.
        drain = asyncio.create_task(self.tracker.drain(self.grace))
        try:
            await super().shutdown(sockets)
        finally:
            if not drain.done():
                drain.cancel()
            # Connections are closed: whatever is left has no reader.
            self.tracker.cancel_all("shutdown")


def make_server(
    app: Any,
    host: str,
    port: int,
    log_level: str,
    grace: float,
    *,
    max_connections: int = 1000,
    keep_alive_timeout: float = 5.0,
) -> GracefulServer:
    """The uvicorn server for `flashserve serve`: graceful shutdown, bounded connections."""
    from flashserve.server.http.connections import ACCEPT_BACKLOG, bounded_protocol

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        # server.middleware writes one access line per request, with its request id.
        access_log=False,
        # Backstop only: the drain ends generations after `grace`; this bounds a
        # connection that still does not close (e.g. a client that stopped reading).
        timeout_graceful_shutdown=grace + FLUSH_MARGIN_S,
        # Idle connections are closed to stay within max_connections (http/connections.py);
        # a request arriving while more are open, all busy, gets 503. uvicorn counts
        # the new connection too, hence + 1.
        http=bounded_protocol(max_connections),
        limit_concurrency=max_connections + 1,
        backlog=ACCEPT_BACKLOG,
        timeout_keep_alive=keep_alive_timeout,  # typed int, used as call_later's delay
    )
    server = GracefulServer(config, getattr(app.state, "tracker", None), grace)
    _exit_zero_after_signal(server)
    return server


def _exit_zero_after_signal(server: uvicorn.Server) -> None:
    """After a graceful shutdown uvicorn re-raises the signal it caught, under the
    handler that was installed before it started. With the default handlers SIGTERM
    would then kill the process (exit 143) and SIGINT raise KeyboardInterrupt (exit
    130) although shutdown was clean; this handler makes that re-raise a no-op, and
    before uvicorn runs it starts a shutdown. Ctrl-C is a stop request like SIGTERM."""

    def on_signal(signum: int, frame: Any) -> None:
        if not server.should_exit:
            server.handle_exit(signum, frame)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
