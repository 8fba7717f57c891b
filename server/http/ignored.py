"""What clients send that this server accepts and does not act on: logged once.

Agents' bodies carry fields an API of one local model has no use for
(Claude Code's `context_management`, Codex's `client_metadata`, ...) and beta
headers. Refusing them would fail a whole agent turn; dropping them silently
hides what a client expected. Each name is logged once per process, at INFO,
the first time a request carries it; at most MAX_NAMES names are
remembered, so a client inventing names cannot grow memory or the log.

Media inside a tool's output (an agent's Read or view_image tool opened a
PNG) is the same kind of thing: the agent did not choose to send it, and a
400 ends its session (Claude Code does not retry one). For this text-only
server it becomes a short placeholder the model reads instead, logged once
per place and kind. Media a user sends in their own message is still refused.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, model_validator

log = logging.getLogger(__name__)

MAX_NAMES = 1000
MAX_NAME_CHARS = 64

_seen: set[tuple[str, str]] = set()
_lock = threading.Lock()


def note_ignored(where: str, names: Iterable[str], what: str = "field") -> None:
    """Log each of `names` (in `where`) the first time it is seen."""
    for name in names:
        key = (where, str(name)[:MAX_NAME_CHARS])
        with _lock:
            if key in _seen or len(_seen) >= MAX_NAMES:
                continue
            _seen.add(key)
        log.info("%s: %s %r accepted and not acted on", where, what, key[1])


_omitted: set[tuple[str, str]] = set()


def omitted_media(where: str, kind: str = "image") -> str:
    """The text a model reads in place of a tool output's `kind` of media (`where`:
    the dialect's name for the place); logged once per place and kind."""
    with _lock:
        first = (where, kind) not in _omitted
        _omitted.add((where, kind))
    if first:
        log.warning(
            "%s: %s replaced by a placeholder: this model accepts text only (logged once)",
            where,
            kind,
        )
    return f"[{kind} omitted: this model accepts text only]"


class NotesIgnoredFields(BaseModel):
    """A request body whose top-level fields the model does not declare are logged
    (note_ignored) and otherwise ignored, as pydantic does by default."""

    @model_validator(mode="before")
    @classmethod
    def _note_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields)
            known |= {f.alias for f in cls.model_fields.values() if f.alias}
            note_ignored(cls.__name__, (k for k in data if k not in known))
        return data
