"""One prompt-cache file on disk: a cache state, or a segment of one, checksummed.

Layout, little-endian:

    8 B   magic b"FSPCACHE"
    4 B   format version (FORMAT_VERSION)
    4 B   header length H
    32 B  blake2b-256 of the header
    H B   header, JSON: model fingerprint, the tokens this file holds, the
          position of its first token (`start`), the file it continues
          (`parent`, null for a whole state), whether the state can be
          trimmed, the state's skeleton, one (dtype, shape, nbytes) per
          array, blake2b-256 of the payload
    ...   payload: the arrays' bytes, back to back

A state whose layers are plain attention KV is stored as a chain of
segments (prompt_segments.py): this file holds positions [start, start +
len(tokens)) and continues its parent's first `start` positions. Anything
else is stored whole: start 0, no parent.

The skeleton is each cache's class name (from mlx_lm.models.cache) and its
`state` with every array replaced by {"array": i}, so any cache type whose
state is arrays, numbers, strings and lists round-trips (KVCache,
RotatingKVCache, ArraysCache, CacheList, ...). Arrays are stored as raw bytes
of their dtype (bfloat16 included), so a state read back is bit-identical.

`prepare` runs on the worker thread (the thread that owns MLX work): it
evaluates the arrays and takes byte views of them. `write` and `read` touch
only bytes and files, so they can run on any thread.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

from flashserve.engine.kv import cache as kv_cache
from flashserve.engine.prompt_cache import segments as prompt_segments
from flashserve.engine.weights.reader import allocate

MAGIC = b"FSPCACHE"
FORMAT_VERSION = 2  # 2: segments (start, parent); version 1 files are left alone
SUFFIX = ".fpc"
_PREAMBLE = struct.Struct("<8sII32s")

_DTYPES = {
    name: getattr(mx, name)
    for name in (
        "bool_",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
    )
    if hasattr(mx, name)
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class EntryError(ValueError):
    """The file is not a usable entry: corrupt, truncated, or not ours."""


class ForeignEntry(EntryError):
    """A sound entry written by other weights or another cache format."""


@dataclass
class PreparedEntry:
    """A cache state ready to be written; holds byte views of evaluated arrays."""

    tokens: list[int]
    trimmable: bool
    skeleton: list[Any]
    arrays: list[tuple[str, list[int], memoryview]]
    splittable: bool = False  # plain KV: written as segments by position

    @property
    def nbytes(self) -> int:
        """Bytes of the file this entry makes written whole."""
        return self.segment_nbytes(0)

    def segment_nbytes(self, start: int) -> int:
        """Bytes of the file holding positions [start, end) (the header estimated)."""
        if self.splittable:
            payload = prompt_segments.sliced_nbytes(self.arrays, start, len(self.tokens))
        else:
            payload = sum(view.nbytes for _, _, view in self.arrays)
        return _PREAMBLE.size + 12 * (len(self.tokens) - start) + 4096 + payload


@dataclass
class EntryHeader:
    model: str
    tokens: list[int]  # the tokens of this file's positions
    trimmable: bool
    file_bytes: int
    start: int = 0  # position of its first token
    parent: str | None = None  # the file holding the positions before `start`


@dataclass
class Segment:
    """A file read back and checked: its header and its part of the cache state."""

    header: EntryHeader
    cache: list[Any]


def prepare(tokens: list[int], cache: list[Any]) -> PreparedEntry:
    """Serialize-ready view of `cache`, the state after exactly `tokens`.

    Raises TypeError when the state holds something that cannot be stored.
    """
    return prepare_sharing(tokens, cache)[0]


def prepare_sharing(tokens: list[int], cache: list[Any]) -> tuple[PreparedEntry, list[Any]]:
    """`prepare`, and the state rebuilt on the entry's own bytes (no second copy).

    The memory tier keeps that one: a stored state that is a view of the batch's
    live cache would make the batch's next write copy its whole cache (MLX
    copies a buffer something else still holds), and the entry's bytes are a
    copy already.
    """
    arrays: list[mx.array] = []
    skeleton = [[type(c).__name__, _skeleton(c.state, arrays)] for c in cache]
    views = [mx.contiguous(a).reshape(-1).view(mx.uint8) for a in arrays]
    mx.eval(*views)
    described = [(_DTYPE_NAMES[a.dtype], list(a.shape)) for a in arrays]
    entry = PreparedEntry(
        tokens=[int(t) for t in tokens],
        trimmable=bool(mlx_cache.can_trim_prompt_cache(cache)),
        skeleton=skeleton,
        arrays=[(d, s, memoryview(v)) for (d, s), v in zip(described, views, strict=True)],
        splittable=prompt_segments.splittable(tokens, cache),
    )
    shared = _build(skeleton, [(d, s, v) for (d, s), v in zip(described, views, strict=True)])
    return entry, shared


def write(
    path: Path,
    model: str,
    entry: PreparedEntry,
    start: int = 0,
    parent: str | None = None,
    drop_page_cache: bool = False,
    pause: Callable[[], None] = lambda: None,
) -> int:
    """Write `entry` from position `start` on (continuing file `parent`) to `path`
    atomically (temp file, fsync, rename); return the file's bytes.
    `drop_page_cache`: its pages leave the page cache once on disk. `pause` is
    called between pieces of the work (prompt_cache/background.py)."""
    if (start or parent) and not entry.splittable:
        raise ValueError("only plain KV states are written as segments")
    arrays = entry.arrays
    if entry.splittable:  # only the state's positions, not the buffer's spare room
        arrays = prompt_segments.slice_views(arrays, start, len(entry.tokens))
    digest = hashlib.blake2b(digest_size=32)
    for _, _, view in arrays:
        for piece in _pieces(view):
            pause()
            digest.update(piece)
    header = json.dumps(
        {
            "model": model,
            "tokens": entry.tokens[start:],
            "start": start,
            "parent": parent,
            "trimmable": entry.trimmable,
            "skeleton": entry.skeleton,
            "arrays": [[dtype, shape, view.nbytes] for dtype, shape, view in arrays],
            "payload": digest.hexdigest(),
        },
        separators=(",", ":"),
    ).encode()
    header_digest = hashlib.blake2b(header, digest_size=32).digest()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        # Entries hold conversations (their tokens): readable by the owner only.
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(_PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header), header_digest))
            f.write(header)
            for _, _, view in arrays:
                for piece in _pieces(view):
                    pause()
                    f.write(piece)
                    if drop_page_cache:
                        _sync_and_drop(f)
            f.flush()
            os.fsync(f.fileno())
            _drop_pages(f.fileno(), drop_page_cache)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


# Under a memory limit a file's dirty and cached pages are charged to it: a state
# of a few hundred MB written or read at once would take that much room from the
# libraries' code (and the kernel thrashes to write it back). In pieces of this
# size, each on disk and out of the page cache before the next.
THROUGH_BYTES = 16 << 20


def _pieces(view: memoryview) -> Iterator[memoryview]:
    data = memoryview(view).cast("B")
    for start in range(0, len(data), THROUGH_BYTES):
        yield data[start : start + THROUGH_BYTES]


def _sync_and_drop(f: Any) -> None:
    """The piece written so far on disk and out of the page cache."""
    f.flush()
    if hasattr(os, "fdatasync"):
        os.fdatasync(f.fileno())
    else:  # macOS
        os.fsync(f.fileno())
    _drop_pages(f.fileno(), True)


def _drop_pages(fd: int, drop: bool) -> None:
    if drop and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def read_header(path: Path, model: str) -> EntryHeader:
    """The header of the entry at `path`, checked; raises EntryError or ForeignEntry."""
    with open(path, "rb") as f:
        header, _ = _read_header(f, model)
        size = os.fstat(f.fileno()).st_size
    return _entry_header(header, model, size)


def read(path: Path, model: str, drop_page_cache: bool = False) -> Segment:
    """The file at `path`: header and (its part of) the cache state, every byte checked.

    Each array is read straight into an MLX buffer of its own (no copy of the
    payload: a state of a few hundred MB read back under a memory limit would
    otherwise be held twice). `drop_page_cache`: the file's pages are dropped
    from the page cache once read (the memory plan left them no room)."""
    with open(path, "rb") as f:
        header, _ = _read_header(f, model)
        size = os.fstat(f.fileno()).st_size
        specs = header["arrays"]
        if size - f.tell() != sum(n for _, _, n in specs):
            raise EntryError(
                f"payload is {size - f.tell()} bytes, header says otherwise (truncated?)"
            )
        digest = hashlib.blake2b(digest_size=32)
        buffers = []
        for dtype, shape, nbytes in specs:
            buffer, raw = allocate(max(int(nbytes), 1), unwritten=True)
            view = memoryview(raw)[:nbytes]
            for start in range(0, nbytes, THROUGH_BYTES):  # each piece out of the page cache
                piece = view[start : start + THROUGH_BYTES]
                if f.readinto(piece) != len(piece):
                    raise EntryError("truncated payload")
                _drop_pages(f.fileno(), drop_page_cache)
            digest.update(view)
            buffers.append((dtype, shape, buffer if nbytes == buffer.size else buffer[:nbytes]))
    if digest.hexdigest() != header["payload"]:
        raise EntryError("payload checksum mismatch")
    return Segment(_entry_header(header, model, size), _build(header["skeleton"], buffers))


def restore(entry: PreparedEntry) -> list[Any]:
    """A private copy of the state `entry` holds (its write may still be queued):
    what writing it whole and reading it back gives, without the disk."""
    views = entry.arrays
    if entry.splittable:  # only the state's positions, not the buffer's spare room
        views = prompt_segments.slice_views(views, 0, len(entry.tokens))
    buffers = [(dtype, shape, np.frombuffer(view, dtype=np.uint8)) for dtype, shape, view in views]
    cache = _build(entry.skeleton, buffers)
    return prompt_segments.join([cache], [len(entry.tokens)]) if entry.splittable else cache


def _build(
    skeleton: list[Any], buffers: list[tuple[str, list[int], np.ndarray | mx.array]]
) -> list[Any]:
    """The caches of `skeleton`, their arrays from raw bytes (dtype, shape): numpy's are
    copied, an MLX uint8 buffer is viewed."""
    arrays = []
    for dtype, shape, raw in buffers:
        if dtype not in _DTYPES:
            raise EntryError(f"unknown dtype {dtype!r}")
        data = raw if isinstance(raw, mx.array) else mx.array(raw)
        arrays.append(data.view(_DTYPES[dtype]).reshape(shape))
    return [_cache_class(name).from_state(_rebuild(state, arrays)) for name, state in skeleton]


def _entry_header(header: dict[str, Any], model: str, size: int) -> EntryHeader:
    start, parent = header.get("start"), header.get("parent")
    if not isinstance(start, int) or start < 0 or (start > 0) != isinstance(parent, str):
        raise EntryError("segment start and parent disagree")
    return EntryHeader(model, header["tokens"], header["trimmable"], size, start, parent)


def _read_header(f: Any, model: str) -> tuple[dict[str, Any], int]:
    preamble = f.read(_PREAMBLE.size)
    if len(preamble) < _PREAMBLE.size:
        raise EntryError("truncated before the header")
    magic, version, length, digest = _PREAMBLE.unpack(preamble)
    if magic != MAGIC:
        raise EntryError("not a flashserve prompt-cache file")
    if version != FORMAT_VERSION:
        raise ForeignEntry(f"cache format {version}, this flashserve reads {FORMAT_VERSION}")
    raw = f.read(length)
    if len(raw) < length or hashlib.blake2b(raw, digest_size=32).digest() != digest:
        raise EntryError("header checksum mismatch (truncated or corrupt)")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise EntryError(f"unreadable header: {exc}") from None
    if header.get("model") != model:
        raise ForeignEntry("made by other weights")
    return header, _PREAMBLE.size + length


def _skeleton(value: Any, arrays: list[mx.array]) -> Any:
    if isinstance(value, mx.array):
        arrays.append(value)
        return {"array": len(arrays) - 1}
    if isinstance(value, (list, tuple)):
        return [_skeleton(v, arrays) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cache state holds a {type(value).__name__}, which is not stored")


def _rebuild(value: Any, arrays: list[mx.array]) -> Any:
    if isinstance(value, dict):
        try:
            return arrays[value["array"]]
        except (KeyError, IndexError, TypeError):
            raise EntryError("skeleton names an array the file does not hold") from None
    if isinstance(value, list):
        return [_rebuild(v, arrays) for v in value]
    return value


def _cache_class(name: str) -> type:
    # flashserve's quantized cache (kv_bits) first, then mlx-lm's classes.
    cls = getattr(kv_cache, name, None) if name.startswith("Quantized") else None
    cls = cls or getattr(mlx_cache, name, None)
    if not isinstance(cls, type) or not hasattr(cls, "from_state"):
        raise EntryError(f"unknown cache class {name!r}")
    return cls
