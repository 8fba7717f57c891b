"""Stored /v1/responses (`store: true`): a bounded SQLite table under the data directory.

One row per response: the Response object as returned (GET answers it), and
the conversation it ended, as Responses input items (the resolved input, the
chain before it included, plus the output items). A later request naming it in
`previous_response_id` prepends those items to its own input, so each row is
self-contained: evicting an older response never breaks a newer one's chain.

Rows are kept in insertion order and at most `max_rows` of them; the oldest
go first. sqlite3 is blocking, so every call runs in `asyncio.to_thread`,
serialised by a lock on one connection. The file survives restarts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILE_NAME = "responses.sqlite3"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    response TEXT NOT NULL,
    conversation TEXT NOT NULL
)
"""


def default_data_dir() -> Path:
    """Where the data directory is unless `data_dir` says otherwise."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "flashserve"
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "flashserve"


def _could_be_ours(response_id: str) -> bool:
    # Ours are resp_ + hex; anything else (a lone surrogate SQLite cannot even
    # encode, a megabyte of text) is not looked up.
    return response_id.isascii() and len(response_id) <= 256


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object, as JSON data
    conversation: list[dict[str, Any]]  # input items, then output items


class ResponseStore:
    """The table, opened on first use. `max_rows` 0 stores nothing (and opens no file)."""

    def __init__(self, data_dir: str | Path | None, max_rows: int):
        self.path = Path(data_dir).expanduser() if data_dir else default_data_dir()
        self.path = self.path / FILE_NAME
        self.max_rows = max_rows
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    @property
    def enabled(self) -> bool:
        return self.max_rows > 0

    async def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if self.enabled:
            await asyncio.to_thread(self._put, response, conversation)

    async def get(self, response_id: str) -> StoredResponse | None:
        if not self.enabled or not _could_be_ours(response_id):
            return None
        return await asyncio.to_thread(self._get, response_id)

    async def delete(self, response_id: str) -> bool:
        if not self.enabled or not _could_be_ours(response_id):
            return False
        return await asyncio.to_thread(self._delete, response_id)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    # -- on a worker thread ---------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            # WAL: a crash mid-write never loses committed rows; readers never block.
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(_SCHEMA)
            self._db = db
            log.info("response store: %s (at most %d responses)", self.path, self.max_rows)
        return self._db

    def _put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            db = self._connect()
            with db:  # one transaction: the insert and the trim
                db.execute("BEGIN")
                db.execute(
                    "INSERT OR REPLACE INTO responses (id, response, conversation) "
                    "VALUES (?, ?, ?)",
                    (response["id"], json.dumps(response), json.dumps(conversation)),
                )
                # Keep the newest max_rows rows.
                db.execute(
                    "DELETE FROM responses WHERE seq <= "
                    "(SELECT seq FROM responses ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                    (self.max_rows,),
                )

    def _get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = (
                self._connect()
                .execute(
                    "SELECT response, conversation FROM responses WHERE id = ?", (response_id,)
                )
                .fetchone()
            )
        if row is None:
            return None
        return StoredResponse(json.loads(row[0]), json.loads(row[1]))

    def _delete(self, response_id: str) -> bool:
        with self._lock:
            cursor = self._connect().execute("DELETE FROM responses WHERE id = ?", (response_id,))
            return cursor.rowcount > 0
