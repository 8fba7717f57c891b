"""The prompt cache's SSD tier: cache states in files, LRU by bytes, across restarts.

Every state the memory tier stores is also written here (write-through, on a
writer thread of its own), so an entry the memory tier evicts, and every
entry after a restart, is still found. A hit is read back and checked
instead of prefilled.

- Only what is new is written. Attention KV is stored as a tree of
  segments (prompt_segments.py): a state's file holds the positions past the
  longest prefix already on disk and names the file it continues, so a
  growing conversation writes each turn's new tokens once. A state that
  cannot be cut by position (recurrent state) is written whole.
- One file per segment, named `<model fingerprint>-<token digest>.fpc`
  (format: prompt_files.py; the digest is of every token up to the file's
  end), written atomically and checksummed. The fingerprint
  (weights/fingerprint.py) keeps entries of other weights apart: they are
  never read as ours.
- The directory is bounded as a whole by `max_bytes`, least recently used
  first out (the files' mtimes carry recency across restarts), entries of
  other models included. Using a chain refreshes every file in it, its root
  last, so a parent is never older than its children; deleting a file
  deletes the files that continue it (a chain is never served short).
- A file that turns out corrupt or truncated is deleted with a warning and
  counted as `discarded`, with the files that continue it; the request
  prefills instead.
- A whole trimmable state makes its own prefixes redundant: writing it
  deletes them, as the memory tier does.
- `write_bytes_per_hour` caps what is written (prompt_budget.py); states past
  it are dropped, and the first drop is logged.

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

from flashserve.engine.compute import heap
from flashserve.engine.prompt_cache import background
from flashserve.engine.prompt_cache import files as prompt_files
from flashserve.engine.prompt_cache import segments as prompt_segments
from flashserve.engine.prompt_cache.budget import WriteBudget
from flashserve.engine.prompt_cache.files import EntryHeader, ForeignEntry, PreparedEntry

log = logging.getLogger(__name__)

_KEY = "entries"  # the one model of the trie: every entry indexed here is ours
_WRITE_QUEUE = 8  # states waiting to be written; more are dropped, not blocked on
_STALE_TMP_S = 3600.0  # an older temp file is a crashed write


def default_dir(fingerprint: str | None = None) -> Path:
    """Where entries go unless `prompt_cache_dir` says otherwise: a folder per
    model (its weights' fingerprint), so models never share one budget."""
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches" / "flashserve" / "prompt-cache"
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        base = Path(cache) / "flashserve" / "prompt-cache"
    return base / fingerprint[:16] if fingerprint else base


@dataclass
class DiskStats:
    hits: int = 0  # prompts that started from an entry read back, or still queued
    misses: int = 0  # prompts the memory tier missed and no entry here could serve
    bytes_read: int = 0
    bytes_written: int = 0
    written: int = 0  # entries written
    evicted: int = 0  # entries deleted to stay within max_bytes (or made redundant)
    discarded: int = 0  # corrupt or truncated entries deleted
    write_errors: int = 0  # writes that failed (disk full, permissions): logged
    dropped: int = 0  # states not written: the writer was behind, or past the budget
    dropped_over_budget: int = 0  # of those, past write_bytes_per_hour


@dataclass
class _Entry:
    name: str
    own: list[int]  # the tokens of the file's positions (the trie holds whole states)
    trimmable: bool
    start: int = 0  # position of own[0]
    parent: str | None = None  # the file holding the positions before `start`

    @property
    def end(self) -> int:
        return self.start + len(self.own)


class DiskTier:
    """Prompt-cache entries of one model in `directory`, bounded by `max_bytes`."""

    def __init__(
        self,
        directory: Path,
        max_bytes: int,
        model: str,
        write_bytes_per_hour: int = 0,
        drop_page_cache: bool = False,
        yield_to_prefills: bool = True,
    ) -> None:
        self.directory = Path(directory).expanduser()
        # Under a memory plan with no memory tier, the page cache of what is written
        # and read back would be charged to the limit: dropped once done with.
        self.drop_page_cache = drop_page_cache
        # Lowest priority, pauses while prompts prefill (background.py); under a
        # memory plan not: a queued state holds its bytes until written.
        self.yield_to_prefills = yield_to_prefills
        self.max_bytes = int(max_bytes)
        self.model = model
        self.stats = DiskStats()
        self.budget = WriteBudget(write_bytes_per_hour)
        self._over_budget_logged = False
        self._prefix = model[:16]
        self._lock = threading.Lock()
        self._trie = PromptTrie()
        self._ours: dict[str, _Entry] = {}
        self._sizes: OrderedDict[str, int] = OrderedDict()  # every file, oldest use first
        self._jobs: queue.Queue[PreparedEntry | None] = queue.Queue(_WRITE_QUEUE)
        self._queued: list[PreparedEntry] = []  # entries put and not yet written
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
        """(tokens, cache state) of entry `name`, every file of its chain read and
        checked; None (the broken file and what continues it gone) if one is bad."""
        with self._lock:
            chain = self._chain(name)
        if chain is None:
            log.warning("prompt cache entry %s vanished; prefilling instead", name)
            self._forget(name)
            return None
        caches, lengths = [], []
        for entry, end in chain:
            try:
                segment = prompt_files.read(
                    self.directory / entry.name, self.model, self.drop_page_cache
                )
                _check_segment(segment.header, entry, end)
            except FileNotFoundError:
                log.warning("prompt cache entry %s vanished; prefilling instead", entry.name)
                self._delete(entry.name)  # and the files continuing it: unreadable now
                return None
            except Exception as exc:  # whatever is wrong with the file, it is not served
                log.warning(
                    "prompt cache entry %s discarded (%s); prefilling instead", entry.name, exc
                )
                self.stats.discarded += 1
                self._delete(entry.name)
                return None
            caches.append(segment.cache)
            lengths.append(end - entry.start)
        cache = prompt_segments.join(caches, lengths)
        # The writer may have evicted part of the chain since lookup() found it:
        # what was read is checked and still served.
        self.stats.bytes_read += self._touch([entry.name for entry, _ in reversed(chain)])
        return _chain_tokens(chain), cache

    def contains(self, tokens: list[int]) -> bool:
        with self._lock:
            return self._trie.search(_KEY, tokens).exact is not None

    def put(self, entry: PreparedEntry) -> None:
        """Queue `entry` for writing; dropped (and counted) when the writer is behind."""
        with self._lock:
            self._queued.append(entry)
        try:
            self._jobs.put_nowait(entry)
        except queue.Full:
            self.stats.dropped += 1
            self._done(entry)

    def queued(self, prompt: list[int]) -> tuple[PreparedEntry, int] | None:
        """(entry, prompt tokens it can serve) of the best entry still waiting to be
        written, its state taken from memory (prompt_files.restore), not from disk.

        An agent sends its next turn the moment an answer ends, while that
        answer's state may still be on its way to disk (and, larger than the
        memory tier, already gone from memory). The queued entry holds the
        state's bytes until it is written: the lookup takes them there and
        waits for no write, its own or another conversation's (the worker
        thread would hold every stream meanwhile).
        """
        with self._lock:
            queued = list(self._queued)
        best = None
        for entry in queued:
            common = 0
            for a, b in zip(entry.tokens, prompt, strict=False):
                if a != b:
                    break
                common += 1
            usable = min(common, len(prompt) - 1)
            if len(entry.tokens) > usable and not entry.trimmable:
                continue  # recurrent state cannot be cut back to the common prefix
            if usable > 0 and (best is None or usable > best[1]):
                best = (entry, usable)
        return best

    def _done(self, entry: PreparedEntry) -> None:
        with self._lock:
            for i, queued in enumerate(self._queued):
                if queued is entry:
                    del self._queued[i]
                    break

    def queued_bytes(self) -> int:
        """Bytes of states in memory waiting to be written."""
        with self._lock:
            return sum(entry.nbytes for entry in self._queued)

    def wait_written(self, entry: PreparedEntry, timeout: float) -> bool:
        """Wait until `entry` is written (or dropped), not for the writes queued after
        it; False on timeout."""
        deadline = time.monotonic() + timeout
        with background.waited_for():
            while time.monotonic() < deadline:
                with self._lock:
                    if not any(queued is entry for queued in self._queued):
                        return True
                time.sleep(0.005)
        return False

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued entry is written; False on timeout."""
        deadline = time.monotonic() + timeout
        with background.waited_for():
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
            "write_bytes_per_hour": self.budget.bytes_per_hour,
            "bytes_written_last_hour": self.budget.last_hour(),
            **asdict(self.stats),
        }

    # -- the writer thread ----------------------------------------------------------

    def _write_loop(self) -> None:
        if self.yield_to_prefills:
            background.lower_priority()
        while (entry := self._jobs.get()) is not None:
            try:
                self._write(entry)
            except Exception:
                log.exception("prompt cache entry could not be written")
            finally:
                self._done(entry)
                self._jobs.task_done()
            del entry
            heap.trim()  # the state written is gone (compute/heap.py)
        self._jobs.task_done()

    def _write(self, entry: PreparedEntry) -> None:
        if self.contains(entry.tokens):
            return
        start, parent, chain = 0, None, []
        if entry.splittable:
            with self._lock:
                start, parent = self._attach_point(entry.tokens)
                chain = (self._chain(parent) or []) if parent is not None else []
            if start >= len(entry.tokens):
                return  # a stored state already holds these tokens and more
        nbytes = entry.segment_nbytes(start)
        if nbytes > self.max_bytes:
            return
        if not self.budget.allows(nbytes):
            self._drop_over_budget()
            return
        digest = hashlib.blake2b(repr(entry.tokens).encode(), digest_size=16).hexdigest()
        name = f"{self._prefix}-{digest}{prompt_files.SUFFIX}"
        # Prefixes of a whole trimmable state are redundant once it is written:
        # they make room for it before anything else is evicted.
        redundant = self._prefixes_of(entry.tokens) if entry.trimmable and not parent else []
        keep = {e.name for e, _ in chain}
        with self._lock:
            room = sum(self._sizes.get(old, 0) for old in redundant)
        self._evict_to(self.max_bytes - nbytes + room, keep=keep | set(redundant))
        try:
            size = prompt_files.write(
                self.directory / name,
                self.model,
                entry,
                start,
                parent,
                self.drop_page_cache,
                background.pauser() if self.yield_to_prefills else lambda: None,
            )
        except OSError as exc:
            log.warning("prompt cache entry not written (%s); disk tier goes on", exc)
            self.stats.write_errors += 1
            return
        self.budget.spend(size)
        self.stats.written += 1
        self.stats.bytes_written += size
        with self._lock:
            # The worker may have discarded the parent (a bad file) meanwhile.
            orphan = parent is not None and parent not in self._ours
            if not orphan:
                self._add(name, entry.tokens, entry.trimmable, size, start, parent)
        if orphan:
            (self.directory / name).unlink(missing_ok=True)
            return
        self._touch([name, *(e.name for e, _ in reversed(chain))])  # the root newest
        for old in redundant:
            self.stats.evicted += 1
            self._delete(old)
        self._evict_to(self.max_bytes)

    def _attach_point(self, tokens: list[int]) -> tuple[int, str | None]:
        """(position, file) where a new segment of `tokens` starts: the end of the
        longest prefix on disk, inside the deepest file of that chain holding it."""
        found = self._trie.search(_KEY, tokens)
        stored = found.longer or found.shorter
        if stored is None:
            return 0, None
        common = found.common_prefix if found.longer else len(found.shorter)
        entry: _Entry | None = self._trie.get(_KEY, stored)
        while entry is not None and entry.start >= common:
            entry = self._ours.get(entry.parent) if entry.parent else None
        if entry is None or common <= 0:
            return 0, None
        return common, entry.name

    def _chain(self, name: str) -> list[tuple[_Entry, int]] | None:
        """The files entry `name` is read from, root first, each with the position
        its part ends at; None when one is missing. Under the lock."""
        chain: list[tuple[_Entry, int]] = []
        entry = self._ours.get(name)
        end = entry.end if entry is not None else 0
        while entry is not None:
            chain.append((entry, end))
            if entry.parent is None:
                return chain[::-1]
            end = entry.start
            entry = self._ours.get(entry.parent)
        return None

    def _touch(self, names: list[str]) -> int:
        """Mark `names` used, in order (the last newest); return their bytes."""
        total = 0
        with self._lock:
            for name in names:
                total += self._sizes.get(name, 0)
                if name in self._sizes:
                    self._sizes.move_to_end(name)
        for name in names:
            with contextlib.suppress(OSError):
                os.utime(self.directory / name)  # recency survives a restart
        return total

    def _drop_over_budget(self) -> None:
        self.stats.dropped += 1
        self.stats.dropped_over_budget += 1
        if not self._over_budget_logged:
            self._over_budget_logged = True
            log.warning(
                "prompt cache: past the disk write budget (%d bytes an hour); states "
                "stay in memory until it frees up",
                self.budget.bytes_per_hour,
            )

    def _prefixes_of(self, tokens: list[int]) -> list[str]:
        with self._lock:  # whole states only: no parent, no children
            parents = {e.parent for e in self._ours.values()}
            return [
                e.name
                for e in self._ours.values()
                if e.parent is None
                and e.end < len(tokens)
                and tokens[: e.end] == e.own
                and e.name not in parents
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
        headers: dict[str, EntryHeader] = {}
        for _, name, size in sorted(found):
            self._sizes[name] = size
            if not name.startswith(self._prefix):
                continue  # another model's: counted in the budget, never read
            try:
                headers[name] = prompt_files.read_header(self.directory / name, self.model)
            except ForeignEntry:
                continue
            except Exception as exc:  # corrupt, truncated, unreadable: not ours to keep
                log.warning("prompt cache entry %s discarded (%s)", name, exc)
                self.stats.discarded += 1
                self._delete(name, in_trie=False)
        depths = _depths(headers)
        for name in headers:
            if name not in depths:  # continues a file that is gone: never served
                self.stats.evicted += 1
                self._delete(name, in_trie=False)
        # Parents before children (a child's tokens start with its parent's);
        # the order of use stays that of the files' times.
        for name in sorted(depths, key=depths.__getitem__):
            header = headers[name]
            before = self._tokens(header.parent)[: header.start] if header.parent else []
            self._add(
                name,
                [*before, *header.tokens],
                header.trimmable,
                self._sizes[name],
                header.start,
                header.parent,
                use=False,
            )
        if self._ours:
            log.info("prompt cache: %d files on disk in %s", len(self._ours), self.directory)

    def _add(
        self,
        name: str,
        tokens: list[int],
        trimmable: bool,
        size: int,
        start: int = 0,
        parent: str | None = None,
        use: bool = True,
    ) -> None:
        """Index file `name`, holding `tokens` (the whole state's) from `start` on."""
        entry = _Entry(name, [int(t) for t in tokens[start:]], trimmable, start, parent)
        previous = self._trie.add(_KEY, list(tokens), entry)
        if previous is not None and previous.name != name:
            self._ours.pop(previous.name, None)
        self._ours[name] = entry
        self._sizes[name] = size
        if use:
            self._sizes.move_to_end(name)

    def _tokens(self, name: str) -> list[int]:
        """The whole state's tokens of indexed file `name` (its chain must be whole)."""
        chain = self._chain(name)
        if chain is None:
            raise KeyError(name)
        return _chain_tokens(chain)

    def _forget(self, name: str, in_trie: bool = True) -> list[str]:
        """Drop `name` and the files that continue it from the index; return their names."""
        with self._lock:
            gone = [name]
            for child in gone:  # grows as children are found: the whole subtree
                gone.extend(e.name for e in self._ours.values() if e.parent == child)
            # Each file's whole tokens (to find it in the trie), before any goes.
            paths = {}
            for old in gone:
                entry = self._ours.get(old)
                if entry is None:
                    continue
                if entry.parent in paths:
                    paths[old] = [*paths[entry.parent][: entry.start], *entry.own]
                else:
                    with contextlib.suppress(KeyError):
                        paths[old] = self._tokens(old)
            for old in gone:
                self._sizes.pop(old, None)
                self._ours.pop(old, None)
                if in_trie and old in paths:
                    with contextlib.suppress(KeyError):
                        self._trie.pop(_KEY, paths[old])
        return gone

    def _delete(self, name: str, in_trie: bool = True) -> None:
        """Delete `name` and the files that continue it (they cannot be read without it)."""
        gone = self._forget(name, in_trie)
        self.stats.evicted += len(gone) - 1
        for old in gone:
            try:
                (self.directory / old).unlink(missing_ok=True)
            except OSError as exc:
                log.warning("prompt cache entry %s could not be deleted: %s", old, exc)


def _depths(headers: dict[str, EntryHeader]) -> dict[str, int]:
    """Each file's depth in its chain (0: a root); files whose chain is broken (a
    parent missing, shorter than where the file starts, or a cycle) left out."""
    depths: dict[str, int] = {}
    for name in headers:
        path, at = [], name
        while at not in depths:
            header = headers.get(at)
            if header is None or at in path:
                break  # missing, or a cycle: nothing on this path is served
            if header.parent is None:
                depths[at] = 0
                break
            parent = headers.get(header.parent)
            if parent is None or parent.start + len(parent.tokens) < header.start:
                break
            path.append(at)
            at = header.parent
        if at in depths:  # the path hangs off a sound file: number it back down
            for depth, child in enumerate(reversed(path), start=depths[at] + 1):
                depths[child] = depth
    return depths


def _chain_tokens(chain: list[tuple[_Entry, int]]) -> list[int]:
    """The tokens a chain's files hold, root first, each up to where the chain cuts it."""
    out: list[int] = []
    for entry, end in chain:
        out.extend(entry.own[: end - entry.start])
    return out


def _check_segment(header: EntryHeader, entry: _Entry, end: int) -> None:
    """The file read is the one indexed: same place in its chain, same tokens."""
    if header.start != entry.start or header.parent != entry.parent:
        raise prompt_files.EntryError("file is not where its chain says")
    if header.tokens != entry.own or entry.end < end:
        raise prompt_files.EntryError("file holds other tokens than its name says")
