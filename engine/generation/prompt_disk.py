"""The prompt cache's SSD tier: cache states in files, LRU by bytes, across restarts.

Every state the memory tier stores is also written here (write-through, on a
writer thread of its own), so an entry the memory tier evicts, and every
entry after a restart, is still found. A hit is read back and checked
instead of prefilled.

- One file per entry, named `<model fingerprint>-<token digest>.fpc`
  (format: prompt_files.py), written atomically and checksummed. The
  fingerprint (weights/fingerprint.py) keeps entries of other weights apart:
  they are never read as ours.
- The directory is bounded as a whole by `max_bytes`, least recently used
  first out (the files' mtimes carry recency across restarts), entries of
  other models included.
- An entry that turns out corrupt or truncated is deleted with a warning and
  counted as `discarded`; the request prefills instead.
- A trimmable state (attention KV) makes its own prefixes redundant: writing
  it deletes them, as the memory tier does.

The worker thread looks up and reads; the writer thread writes and evicts.
One lock guards the index.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import PromptTrie

from flashserve.engine.generation import prompt_files
from flashserve.engine.generation.prompt_files import ForeignEntry, PreparedEntry

log = logging.getLogger(__name__)

_KEY = "entries"  # the one model of the trie: every entry indexed here is ours
_WRITE_QUEUE = 8  # states waiting to be written; more are dropped, not blocked on
_STALE_TMP_S = 3600.0  # an older temp file is a crashed write


def default_dir() -> Path:
    """Where entries go unless `prompt_cache_dir` says otherwise."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "flashserve" / "prompt-cache"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flashserve" / "prompt-cache"


@dataclass
class DiskStats:
    hits: int = 0  # prompts that started from an entry read back from disk
    misses: int = 0  # prompts the memory tier missed and no entry here could serve
    bytes_read: int = 0
    bytes_written: int = 0
    written: int = 0  # entries written
    evicted: int = 0  # entries deleted to stay within max_bytes (or made redundant)
    discarded: int = 0  # corrupt or truncated entries deleted
    write_errors: int = 0  # writes that failed (disk full, permissions): logged
    dropped: int = 0  # states not written because the writer was behind


@dataclass
class _Entry:
    name: str
    tokens: list[int]
    trimmable: bool


class DiskTier:
    """Prompt-cache entries of one model in `directory`, bounded by `max_bytes`."""

    def __init__(self, directory: Path, max_bytes: int, model: str) -> None:
        self.directory = Path(directory).expanduser()
        self.max_bytes = int(max_bytes)
        self.model = model
        self.stats = DiskStats()
        self._prefix = model[:16]
        self._lock = threading.Lock()
        self._trie = PromptTrie()
        self._ours: dict[str, _Entry] = {}
        self._sizes: OrderedDict[str, int] = OrderedDict()  # every file, oldest use first
        self._jobs: queue.Queue[PreparedEntry | None] = queue.Queue(_WRITE_QUEUE)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._scan()
        self._writer = threading.Thread(
            target=self._write_loop, name="flashserve-prompt-disk", daemon=True
        )
        self._writer.start()

    # -- the worker thread ----------------------------------------------------------

    def lookup(self, prompt: list[int]) -> tuple[str, int, int] | None:
        """(entry name, its token count, prompt tokens it can serve) of the best entry."""
        with self._lock:
            found = self._trie.search(_KEY, prompt)
            candidates = []
            if found.exact is not None:
                candidates.append((found.exact, len(prompt) - 1))
            if found.shorter is not None:
                candidates.append((found.shorter, len(found.shorter)))
            if found.longer is not None:
                candidates.append((found.longer, min(len(prompt) - 1, found.common_prefix)))
            best = None
            for tokens, usable in candidates:
                entry: _Entry = self._trie.get(_KEY, tokens)
                if len(tokens) > usable and not entry.trimmable:
                    continue  # recurrent state cannot be cut back to the common prefix
                if usable > 0 and (best is None or usable > best[2]):
                    best = (entry.name, len(tokens), usable)
            return best

    def load(self, name: str) -> tuple[list[int], list[Any]] | None:
        """(tokens, cache state) of entry `name`, checked; None (the file gone) if it is bad."""
        path = self.directory / name
        try:
            tokens, cache = prompt_files.read(path, self.model)
        except FileNotFoundError:
            log.warning("prompt cache entry %s vanished; prefilling instead", name)
            self._forget(name)
            return None
        except Exception as exc:  # whatever is wrong with the file, it is not served
            log.warning("prompt cache entry %s discarded (%s); prefilling instead", name, exc)
            self.stats.discarded += 1
            self._delete(name)
            return None
        with self._lock:
            size = self._sizes.get(name, 0)
            # The writer may have deleted the entry since lookup() found it (a longer
            # state made it redundant): what was read is checked and still served.
            if name in self._sizes:
                self._sizes.move_to_end(name)
        self.stats.bytes_read += size
        with contextlib.suppress(OSError):
            os.utime(path)  # recency survives a restart
        return tokens, cache

    def contains(self, tokens: list[int]) -> bool:
        with self._lock:
            return self._trie.search(_KEY, tokens).exact is not None

    def put(self, entry: PreparedEntry) -> None:
        """Queue `entry` for writing; dropped (and counted) when the writer is behind."""
        try:
            self._jobs.put_nowait(entry)
        except queue.Full:
            self.stats.dropped += 1

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued entry is written; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._jobs.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._jobs.unfinished_tasks

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._jobs.put(None)
        self._writer.join(timeout)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            ours = [self._sizes.get(name, 0) for name in self._ours]
            dir_bytes = sum(self._sizes.values())
        return {
            "dir": str(self.directory),
            "max_bytes": self.max_bytes,
            "entries": len(ours),
            "bytes": sum(ours),
            "dir_bytes": dir_bytes,
            **asdict(self.stats),
        }

    # -- the writer thread ----------------------------------------------------------

    def _write_loop(self) -> None:
        while (entry := self._jobs.get()) is not None:
            try:
                self._write(entry)
            except Exception:
                log.exception("prompt cache entry could not be written")
            finally:
                self._jobs.task_done()
        self._jobs.task_done()

    def _write(self, entry: PreparedEntry) -> None:
        if self.contains(entry.tokens) or entry.nbytes > self.max_bytes:
            return
        digest = hashlib.blake2b(repr(entry.tokens).encode(), digest_size=16).hexdigest()
        name = f"{self._prefix}-{digest}{prompt_files.SUFFIX}"
        # Prefixes of a trimmable state are redundant once it is written: they
        # make room for it before anything else is evicted.
        redundant = self._prefixes_of(entry.tokens) if entry.trimmable else []
        with self._lock:
            room = sum(self._sizes.get(old, 0) for old in redundant)
        self._evict_to(self.max_bytes - entry.nbytes + room, keep=set(redundant))
        try:
            size = prompt_files.write(self.directory / name, self.model, entry)
        except OSError as exc:
            log.warning("prompt cache entry not written (%s); disk tier goes on", exc)
            self.stats.write_errors += 1
            return
        with self._lock:
            self._add(name, entry.tokens, entry.trimmable, size)
        for old in redundant:
            self.stats.evicted += 1
            self._delete(old)
        self.stats.written += 1
        self.stats.bytes_written += size
        self._evict_to(self.max_bytes)

    def _prefixes_of(self, tokens: list[int]) -> list[str]:
        with self._lock:
            return [
                e.name
                for e in self._ours.values()
                if len(e.tokens) < len(tokens) and tokens[: len(e.tokens)] == e.tokens
            ]

    def _evict_to(self, limit: int, keep: set[str] = frozenset()) -> None:
        while True:
            with self._lock:
                if sum(self._sizes.values()) <= max(0, limit):
                    return
                oldest = next((n for n in self._sizes if n not in keep), None)
                if oldest is None:
                    return
            self.stats.evicted += 1
            self._delete(oldest)

    # -- the index ------------------------------------------------------------------

    def _scan(self) -> None:
        """Index the directory: our entries by tokens, every file by size and age."""
        now = time.time()
        found = []
        for path in self.directory.iterdir():
            try:
                st = path.stat()
            except OSError:
                continue
            if not path.is_file():
                continue
            if path.name.endswith(".tmp"):
                if now - st.st_mtime > _STALE_TMP_S:
                    path.unlink(missing_ok=True)
                continue
            if path.suffix == prompt_files.SUFFIX:
                found.append((st.st_mtime, path.name, st.st_size))
        for _, name, size in sorted(found):
            self._sizes[name] = size
            if not name.startswith(self._prefix):
                continue  # another model's: counted in the budget, never read
            try:
                header = prompt_files.read_header(self.directory / name, self.model)
            except ForeignEntry:
                continue
            except Exception as exc:  # corrupt, truncated, unreadable: not ours to keep
                log.warning("prompt cache entry %s discarded (%s)", name, exc)
                self.stats.discarded += 1
                self._delete(name, in_trie=False)
                continue
            self._add(name, header.tokens, header.trimmable, size)
        if self._ours:
            log.info("prompt cache: %d entries on disk in %s", len(self._ours), self.directory)

    def _add(self, name: str, tokens: list[int], trimmable: bool, size: int) -> None:
        entry = _Entry(name, list(tokens), trimmable)
        previous = self._trie.add(_KEY, entry.tokens, entry)
        if previous is not None and previous.name != name:
            self._ours.pop(previous.name, None)
        self._ours[name] = entry
        self._sizes[name] = size
        self._sizes.move_to_end(name)

    def _forget(self, name: str, in_trie: bool = True) -> None:
        with self._lock:
            self._sizes.pop(name, None)
            entry = self._ours.pop(name, None)
            if entry is not None and in_trie:
                with contextlib.suppress(KeyError):
                    self._trie.pop(_KEY, entry.tokens)

    def _delete(self, name: str, in_trie: bool = True) -> None:
        self._forget(name, in_trie)
        try:
            (self.directory / name).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("prompt cache entry %s could not be deleted: %s", name, exc)
