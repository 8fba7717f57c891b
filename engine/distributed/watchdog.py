"""A heartbeat between rank 0 and every other rank, beside MLX's own links.

A rank that dies or hangs would leave the others blocked in a receive (a
ring receive can wait forever), so rank 0 and each other rank exchange a
line of JSON every second over TCP: a closed connection, or silence past
`TIMEOUT_S`, ends the rank that sees it with an error naming the lost rank
(exit code EXIT_LOST_RANK). Rank 0 tells the remaining ranks which rank was
lost before it exits, so every message names the same rank. The followers'
lines also carry their status (layers, memory) for rank 0's /memory.

The same connections carry the channel's messages (channel.py): rank 0's
step announcements arrive here as numbered lines, and a follower waits for
the next one in a blocking read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

EXIT_LOST_RANK = 3
INTERVAL_S = 1.0
TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 60.0


def fatal(message: str, code: int = EXIT_LOST_RANK) -> None:
    """End this rank now: a rank that cannot go on must not leave the others waiting."""
    log.critical(message)
    print(f"flashserve: {message}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(code)


class Watchdog:
    """One rank's side of the heartbeat (rank 0: a listener; others: a client)."""

    def __init__(self, rank: int, size: int, status: Callable[[], dict]) -> None:
        self.rank = rank
        self.size = size
        self.status = status
        self.peers: dict[int, dict] = {}  # rank -> last status (rank 0 only)
        self.closing = False  # a shutdown was announced: connections may end now
        self._conns: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._connected = threading.Event()  # rank 0: every other rank has connected
        self._bell = threading.Condition()
        self._peers_changed = threading.Condition()
        self._messages: dict[int, Any] = {}  # channel messages from rank 0, by number

    # -- rank 0 ---------------------------------------------------------------------

    def listen(self, host: str) -> int:
        """Rank 0: accept the other ranks on `host`; returns the port."""
        listener = socket.create_server((host, 0))
        self._listener = listener
        threading.Thread(target=self._accept, name="fs-watchdog-accept", daemon=True).start()
        return listener.getsockname()[1]

    def _accept(self) -> None:
        assert self._listener is not None
        self._listener.settimeout(CONNECT_TIMEOUT_S)
        for _ in range(self.size - 1):
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                missing = sorted(set(range(1, self.size)) - set(self._conns))
                fatal(f"rank(s) {missing} did not connect to rank 0's watchdog: {exc}")
                return
            conn.settimeout(TIMEOUT_S)
            reader = conn.makefile("r")
            try:
                hello = json.loads(reader.readline())
                rank = int(hello["rank"])
            except (OSError, ValueError, KeyError, TypeError):
                conn.close()
                continue
            with self._lock:
                self._conns[rank] = conn
            threading.Thread(
                target=self._watch, args=(rank, reader), name=f"fs-watchdog-{rank}", daemon=True
            ).start()
        self._connected.set()
        threading.Thread(target=self._beat, name="fs-watchdog-beat", daemon=True).start()

    def wait_connected(self) -> None:
        """Rank 0: until every other rank is connected (a ring must reach them all)."""
        if not self._connected.wait(CONNECT_TIMEOUT_S + 1):
            fatal("the other ranks did not connect to rank 0's watchdog")

    def wait_peers(self, ready: Callable[[dict], bool]) -> None:
        """Rank 0: until every other rank's last status passes `ready` (their
        layers are known before /memory can be asked)."""
        others = range(1, self.size)
        with self._peers_changed:
            if not self._peers_changed.wait_for(
                lambda: all(r in self.peers and ready(self.peers[r]) for r in others),
                CONNECT_TIMEOUT_S,
            ):
                missing = [r for r in others if not ready(self.peers.get(r, {}))]
                fatal(f"rank(s) {missing} did not report ready to rank 0")

    def beat_now(self) -> None:
        """Send this rank's heartbeat (and status) at once, not at the next tick."""
        self._send_all(self._beat_body())

    def post(self, number: int, message: Any) -> None:
        """Rank 0: channel message `number` to every other rank."""
        self._send_all({"go": number, "message": message})

    def take(self, number: int) -> Any:
        """Ranks > 0: channel message `number`, once it has come (a lost rank 0
        ends this process from the watch thread, so this never waits forever)."""
        with self._bell:
            self._bell.wait_for(lambda: number in self._messages)
            return self._messages.pop(number)

    def _lost(self, rank: int, why: str) -> None:
        if self.closing:
            return
        if self.rank == 0:
            # Tell the others which rank it was before leaving.
            self._send_all({"lost": rank, "why": why})
        fatal(f"lost rank {rank} ({why}); every rank stops")

    def goodbye(self) -> None:
        """Rank 0, on shutdown: the others' connections may now end."""
        self.closing = True
        self._send_all({"bye": True})

    # -- ranks > 0 ------------------------------------------------------------------

    def connect(self, host: str, port: int) -> None:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                conn = socket.create_connection((host, port), timeout=TIMEOUT_S)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    fatal(f"cannot reach rank 0's watchdog at {host}:{port}: {exc}")
                time.sleep(0.2)
        conn.settimeout(TIMEOUT_S)
        with self._lock:
            self._conns[0] = conn
        self._send(0, {"rank": self.rank})
        reader = conn.makefile("r")
        threading.Thread(
            target=self._watch, args=(0, reader), name="fs-watchdog-0", daemon=True
        ).start()
        threading.Thread(target=self._beat, name="fs-watchdog-beat", daemon=True).start()

    # -- both -----------------------------------------------------------------------

    def _watch(self, rank: int, reader: Any) -> None:
        while True:
            try:
                line = reader.readline()
            except OSError as exc:  # timeout included
                self._lost(rank, f"no heartbeat for {TIMEOUT_S:.0f} s: {exc}")
                return
            if not line:
                self._lost(rank, "its connection closed: the process ended")
                return
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if "lost" in message and rank == 0:
                fatal(f"lost rank {message['lost']} ({message.get('why')}); every rank stops")
            if "go" in message:
                with self._bell:
                    self._messages[int(message["go"])] = message.get("message")
                    self._bell.notify_all()
            if message.get("bye"):
                self.closing = True
            if "status" in message:
                with self._peers_changed:
                    self.peers[rank] = message["status"]
                    self._peers_changed.notify_all()

    def _beat(self) -> None:
        while True:
            self._send_all(self._beat_body())
            time.sleep(INTERVAL_S)

    def _beat_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"beat": time.time()}
        if self.rank != 0:
            try:
                body["status"] = self.status()
            except Exception as exc:  # a status is nice to have; the beat is not
                log.debug("rank status failed: %s", exc)
        return body

    def _send_all(self, body: dict) -> None:
        with self._lock:
            ranks = list(self._conns)
        for rank in ranks:
            self._send(rank, body)

    def _send(self, rank: int, body: dict) -> None:
        data = (json.dumps(body) + "\n").encode()
        with self._lock:
            conn = self._conns.get(rank)
            if conn is None:
                return
            # A failed send is reported by the reading side, with its reason.
            with contextlib.suppress(OSError):
                conn.sendall(data)
