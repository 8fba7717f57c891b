"""Reading weight files into memory: parallel pread, checksums, a time limit.

Every read of a prepared model's weights goes through here (streamed layers,
resident layers and non-layer weights at load; expert records through the
same pool type). The bytes are read once, straight into an MLX buffer, by
`os.preadv` on daemon threads: the syscall releases the GIL, so a slow or hung
disk never freezes the event loop, /health or signal handling. Each piece of
the file is checked against its CRC32 in the manifest as it lands, on the
thread that read it, so checking costs no second pass over the file. The
tensors are then views of that one buffer (safetensors header parsed here),
exactly what `mx.load` would have returned, without a copy.

A read that makes no progress for `io_timeout` seconds fails the wait with an
error naming the file. The thread stuck in the kernel cannot be stopped; it is
a daemon thread, so it never holds up the process's exit, and the file is
remembered as stalled: later reads of it fail at once, instead of each taking
another thread, until the stuck read returns.
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import queue
import stat
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from flashserve.engine.compute import heap, qmm
from flashserve.engine.weights.checksum import crc32
from flashserve.engine.weights.layout import ALIGN, PAD_PREFIX
from flashserve.engine.weights.model import ModelLoadError

log = logging.getLogger(__name__)

# One read task, and one CRC in the manifest, per chunk. Cold reads of a layer
# file measured as fast as mx.load with 2-4 MiB chunks on 8 threads (8 MiB and
# up: slower, fewer reads in flight).
CHUNK_BYTES = 4 << 20
READ_THREADS = 8  # SSDs want a queue of reads; the syscall releases the GIL
DIRECT_ALIGN = 4096  # O_DIRECT's boundary for offsets, lengths and addresses
_DIRECT_WORKS: dict[int, bool] = {}  # st_dev -> whether direct reads work there

# safetensors dtype names -> MLX dtypes (weights/prepare.py writes the same names)
ST_DTYPES: dict[str, mx.Dtype] = {
    "BOOL": mx.bool_,
    "U8": mx.uint8,
    "I8": mx.int8,
    "U16": mx.uint16,
    "I16": mx.int16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "U64": mx.uint64,
    "I64": mx.int64,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "F32": mx.float32,
    "F64": mx.float64,
}


class WeightFileError(ModelLoadError):
    """A weight file that cannot be read as the manifest describes it: missing,
    changed, damaged (checksum), or stalled. The message names the file."""


class ReadPool:
    """Daemon threads running blocking reads, first in first out.

    Not a ThreadPoolExecutor: its threads are joined at interpreter exit, and
    one stuck in a hung read would then hold the process forever.
    """

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError("a read pool needs at least one thread")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stalled: dict[str, tuple[FileRead, float]] = {}
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def threads(self) -> int:
        return len(self._threads)

    def submit(self, fn: Callable[..., Any], *args: Any, future: Future | None = None) -> Future:
        """Run fn(*args) on a pool thread; its result or exception lands in the future."""
        future = Future() if future is None else future
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def close(self, timeout: float = 1.0) -> bool:
        """Cancel queued work and stop the threads; False if one is stuck in a read."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    # -- stalled files ---------------------------------------------------------

    def stalled_since(self, path: Path) -> float | None:
        """When an earlier read of `path` was found stalled, if it still is."""
        with self._lock:
            found = self._stalled.get(str(path))
            if found is None:
                return None
            if found[0].future.done():
                del self._stalled[str(path)]
                return None
            return found[1]

    def mark_stalled(self, read: FileRead) -> None:
        with self._lock:
            self._stalled.setdefault(str(read.path), (read, time.monotonic()))


_shared: ReadPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> ReadPool:
    """The process's pool for layer and non-layer files (created on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ReadPool(READ_THREADS, "layer-io")
        return _shared


@dataclass
class Piece:
    """One contiguous byte range of a file, read into one or more target views."""

    offset: int
    targets: list[memoryview]  # writable uint8 views; their lengths sum to the range
    crc32: int | None  # of the range's bytes; None: not checked
    # Bytes of the last target past the range: a direct read's length is whole
    # blocks, so the file's last piece reads up to its end into a longer view.
    tail: int = 0

    @property
    def nbytes(self) -> int:
        return sum(len(t) for t in self.targets) - self.tail

    def checked(self) -> list[memoryview]:
        """The targets without the tail: the range's own bytes."""
        if not self.tail:
            return self.targets
        return [*self.targets[:-1], self.targets[-1][: len(self.targets[-1]) - self.tail]]


def preadv_all(
    fd: int, targets: list[memoryview], offset: int, path: Path, need: int | None = None
) -> None:
    """Fill `targets` from `fd` at `offset` (preadv until done; it releases the GIL), or
    their first `need` bytes: the rest lies past the end of the file. WeightFileError
    when the file ends first; OSError as the system gives it."""
    views = list(targets)
    pos = offset
    left = sum(len(v) for v in views) if need is None else need
    while left > 0:
        n = os.preadv(fd, views, pos)
        if n == 0:
            raise WeightFileError(
                f"{path}: ends at byte {pos} (truncated; prepare the model again)"
            )
        pos += n
        left -= n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def open_direct(path: Path, direct: bool) -> tuple[int, bool]:
    """`path` opened for reads that bypass the page cache where this system and file
    system allow; returns (fd, whether reads must be block-aligned). Not `direct`:
    Linux reads go through the page cache (the buffers are a GPU's: whether the
    kernel can read straight into them is not something to find out mid-request)."""
    if hasattr(os, "O_DIRECT") and direct:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:  # a file system without direct I/O (tmpfs on old kernels)
            return os.open(path, os.O_RDONLY), False
        if _direct_reads_work(fd):
            return fd, True
        os.close(fd)
        return os.open(path, os.O_RDONLY), False
    fd = os.open(path, os.O_RDONLY)
    if hasattr(fcntl, "F_NOCACHE"):  # macOS: no alignment needed
        with suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)
    return fd, False


def _direct_reads_work(fd: int) -> bool:
    """Some file systems accept O_DIRECT at open and refuse the read (EINVAL). Asked
    once per file system: each open's test read queued behind the reads in flight,
    and the file's reads waited for it."""
    device = os.fstat(fd).st_dev
    known = _DIRECT_WORKS.get(device)
    if known is not None:
        return known
    page = mmap.mmap(-1, DIRECT_ALIGN)  # page-aligned
    try:
        os.preadv(fd, [page], 0)
        works = True
    except OSError:
        works = False
    finally:
        page.close()
    _DIRECT_WORKS[device] = works
    return works


class FileRead:
    """One file, or the listed ranges of one, being read on a pool.

    Open and size check run on a pool thread too: opening a file on hung
    storage (or a FIFO) blocks. Pieces are grouped into tasks of about
    `task_bytes`; every finished piece counts as progress for `wait`.

    `after`: an earlier read whose end this one's pieces wait for (the file is
    opened meanwhile). Two layers read at once share the disk, which does not
    serve them first come first served: the layer wanted first could end with
    the next one (measured: a streamed layer's 4 MB chunk 17 ms instead of 9,
    then the disk idle while both layers computed). Started as the earlier one
    ends, nothing is left to open or check: the disk goes on at once. A waiter
    starts it whatever the earlier one does (that one was given up: failed,
    stalled or dropped).
    """

    def __init__(
        self,
        path: Path,
        size: int,
        pieces: list[Piece],
        pool: ReadPool,
        *,
        task_bytes: int = CHUNK_BYTES,
        drop_page_cache: bool = False,
        direct: bool = False,
        after: Future | None = None,
    ) -> None:
        self.path = Path(path)
        self._after = after
        self.size = size
        # Around the page cache (open_direct): the pieces are then whole blocks at
        # block-aligned addresses (direct_pieces).
        self._direct = direct
        self.future: Future[None] = Future()
        self._pool = pool
        self._drop_page_cache = drop_page_cache and hasattr(os, "posix_fadvise")
        self._lock = threading.Lock()
        self._progress = time.monotonic()
        self._fd = -1
        self._submitted = False  # the pieces are on the pool
        self._waited = False  # a waiter came: the earlier read is not waited for
        self._tasks: list[list[Piece]] = []
        for piece in pieces:
            if self._tasks and sum(p.nbytes for p in self._tasks[-1]) < task_bytes:
                self._tasks[-1].append(piece)
            else:
                self._tasks.append([piece])
        self._left = len(self._tasks)
        self.future.set_running_or_notify_cancel()
        since = pool.stalled_since(self.path)
        if since is not None:
            self.future.set_exception(
                WeightFileError(
                    f"{self.path}: an earlier read has been stalled for "
                    f"{time.monotonic() - since:.0f} s; the storage under it may be hung"
                )
            )
            return
        pool.submit(self._start)

    @property
    def tasks(self) -> int:
        """Reads of this file that can run at once."""
        return len(self._tasks)

    def _start(self) -> None:
        self._progress = time.monotonic()
        try:
            if self._direct:
                fd, _ = open_direct(self.path, True)
            else:
                fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            self._fail(WeightFileError(f"{self.path}: cannot open: {exc.strerror or exc}"))
            return
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise WeightFileError(f"{self.path}: not a regular file")
            if info.st_size != self.size:
                raise WeightFileError(
                    f"{self.path}: {info.st_size} bytes, the manifest says {self.size} "
                    "(changed since prepare; prepare the model again)"
                )
        except (OSError, WeightFileError) as exc:
            os.close(fd)
            self._fail(exc if isinstance(exc, WeightFileError) else WeightFileError(str(exc)))
            return
        if not self._tasks:
            self._fd = fd
            self._finish_task()
            return
        after, self._after = self._after, None  # not kept: it holds the read before
        with self._lock:
            self._fd = fd
            hold = after is not None and not after.done() and not self._waited
        if hold:
            after.add_done_callback(self._submit)
        else:
            self._submit()

    def _submit(self, _: Any = None) -> None:
        """The earlier read ended (however it ended), or a waiter came first (that one
        was given up): this one's pieces go on the pool, once, where the file is open."""
        with self._lock:
            if self._submitted or self._fd < 0:
                return
            self._submitted = True
        self._progress = time.monotonic()
        for task in self._tasks:
            self._pool.submit(self._run, task)

    def _run(self, task: list[Piece]) -> None:
        try:
            for piece in task:
                if self.future.done():  # failed elsewhere: stop reading
                    break
                self._progress = time.monotonic()
                preadv_all(self._fd, piece.targets, piece.offset, self.path, piece.nbytes)
                if piece.crc32 is not None:
                    crc = 0
                    for target in piece.checked():
                        crc = crc32(target, crc)
                    if crc != piece.crc32:
                        end = piece.offset + piece.nbytes
                        raise WeightFileError(
                            f"{self.path}: checksum mismatch in bytes {piece.offset}..{end} "
                            "(the file is damaged; run flashserve prepare --force again)"
                        )
                self._progress = time.monotonic()
        except WeightFileError as exc:
            self._fail(exc)
        except OSError as exc:
            self._fail(WeightFileError(f"{self.path}: cannot read: {exc.strerror or exc}"))
        finally:
            self._finish_task()

    def _finish_task(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left <= 0
            if last:
                if not self.future.done():
                    self.future.set_result(None)
                if self._drop_page_cache:
                    # Benchmarks: the next read of this file comes from disk again.
                    # After the result, so the waiter does not wait for the eviction.
                    os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(self._fd)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if not self.future.done():
                self.future.set_exception(exc)

    def wait(self, timeout: float) -> None:
        """Until every piece is read and checked; WeightFileError if not.

        Fails when no piece has finished for `timeout` seconds: a stall, not a
        slow file (a large file on slow storage keeps making progress).
        """
        with self._lock:
            self._waited = True
        self._submit()
        while True:
            left = self._progress + timeout - time.monotonic()
            if left <= 0 and not self.future.done():
                self._pool.mark_stalled(self)
                raise WeightFileError(
                    f"{self.path}: read stalled (no progress for {timeout:g} s, io_timeout); "
                    "the storage under it may be hung"
                )
            try:
                self.future.result(timeout=max(left, 0.0))
                return
            except FutureTimeout:  # the builtin TimeoutError from Python 3.11
                continue


def allocate(size: int, unwritten: bool = False) -> tuple[mx.array, np.ndarray]:
    """An MLX uint8 buffer and numpy's writable view of it. Call on the MLX thread.

    `unwritten`: not zero-filled first, where flashserve's extension can make it
    (the read that fills it faults its pages in on the I/O thread, not the MLX
    stream; experts/store.py does the same).
    """
    make = None
    if unwritten and mx.default_device() == mx.cpu and 0 < size < 1 << 31:
        make = getattr(qmm.extension(), "uninitialized_bytes", None)
    buffer = make(size) if make is not None else mx.zeros((size,), dtype=mx.uint8)
    mx.eval(buffer)
    raw = np.array(buffer, copy=False)
    if make is not None:  # untouched: the read faults its pages in, 2 MB ones if asked
        heap.huge_pages(raw.ctypes.data, size)
    return buffer, raw


def chunk_pieces(
    raw: np.ndarray, crcs: list[int] | None, chunk_bytes: int, size: int | None = None
) -> list[Piece]:
    """Pieces covering a whole file of `size` bytes (default: all of `raw`) read into
    `raw`, one per checksum chunk. Where `raw` is longer, the last piece reads up
    to the next DIRECT_ALIGN boundary (a direct read's whole block)."""
    size = raw.size if size is None else size
    count = -(-size // chunk_bytes)
    if crcs is not None and len(crcs) != count:
        raise ValueError(f"{len(crcs)} checksums for {count} chunks of {size} bytes")
    view = memoryview(raw)
    pieces = [
        Piece(
            k * chunk_bytes,
            [view[k * chunk_bytes : min((k + 1) * chunk_bytes, size)]],
            None if crcs is None else crcs[k],
        )
        for k in range(count)
    ]
    end = min(raw.size, -(-size // DIRECT_ALIGN) * DIRECT_ALIGN)
    if pieces and end > size:
        last = pieces[-1]
        last.targets = [view[last.offset : end]]
        last.tail = end - size
    return pieces


def direct_base(raw: np.ndarray) -> int:
    """Where in `raw` a direct read may start: the first block-aligned address (a
    buffer of DIRECT_SLACK bytes more than the file holds the file from there)."""
    return -raw.ctypes.data % DIRECT_ALIGN


DIRECT_SLACK = 2 * DIRECT_ALIGN  # an aligned start, and the last block's end


def file_crcs(path: Path, chunk_bytes: int = CHUNK_BYTES) -> list[int]:
    """CRC32 of each `chunk_bytes` piece of a file (what the manifest records)."""
    out = []
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            out.append(crc32(chunk))
    return out


def safetensors_views(
    buffer: mx.array, raw: np.ndarray, path: Path, base: int = 0
) -> dict[str, mx.array]:
    """The tensors of a safetensors file held whole in `buffer` from byte `base`, as
    views of it."""
    return views_of(buffer, raw, safetensors_entries(raw, path, base))


def views_of(
    buffer: mx.array, raw: np.ndarray, entries: dict[str, tuple[mx.Dtype, int, int, list[int]]]
) -> dict[str, mx.array]:
    """safetensors_entries' tensors as views of `buffer`."""
    return {
        name: view_as(buffer, raw, a, b, dtype, shape)
        for name, (dtype, a, b, shape) in entries.items()
    }


def safetensors_entries(
    raw: np.ndarray, path: Path, base: int = 0
) -> dict[str, tuple[mx.Dtype, int, int, list[int]]]:
    """The tensors of a safetensors file held whole in `raw` from byte `base`:
    {name: (dtype, start, end, shape)}, offsets into `raw`."""
    try:
        (n,) = struct.unpack("<Q", raw[base : base + 8].tobytes())
        header = json.loads(raw[base + 8 : base + 8 + n].tobytes())
    except (struct.error, ValueError) as exc:
        raise WeightFileError(f"{path}: not a safetensors file ({exc})") from None
    start = base + 8 + n
    out = {}
    for name, spec in header.items():
        if name == "__metadata__" or name.startswith(PAD_PREFIX):
            continue
        dtype = ST_DTYPES.get(spec.get("dtype"))
        a, b = (start + int(o) for o in spec["data_offsets"])
        shape = [int(d) for d in spec["shape"]]
        if dtype is None or b > raw.size or b - a != int(np.prod(shape)) * dtype.size:
            raise WeightFileError(f"{path}: bad header entry for {name}")
        out[name] = (dtype, a, b, shape)
    return out


def view_as(
    buffer: mx.array, raw: np.ndarray, start: int, end: int, dtype: mx.Dtype, shape: list[int]
) -> mx.array:
    """Bytes start..end of `buffer` as a tensor; a view, or a copy where misaligned."""
    piece = buffer[start:end] if can_view(start, dtype) else mx.array(raw[start:end].copy())
    return piece.view(dtype).reshape(shape)


def can_view(offset: int, dtype: mx.Dtype) -> bool:
    """Whether a tensor at `offset` in a read buffer may be a view of it.

    Off the CPU only at multiples of ALIGN: MLX's CUDA matmuls fail on views
    aligned to the element size alone (cublasLtMatmul code 15), and Metal
    kernels assume aligned buffers. Prepared files (format 2) put every tensor
    there; anything else is copied on the CPU first. The CPU's kernels need
    only the element size.
    """
    if offset % ALIGN == 0:
        return True
    return mx.default_device() == mx.cpu and offset % max(dtype.size, 1) == 0


def read_tensors(
    path: Path,
    size: int,
    crcs: list[int] | None,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    timeout: float = 30.0,
    pool: ReadPool | None = None,
) -> dict[str, mx.array]:
    """Read and check one safetensors file now (MLX thread); views of one buffer."""
    buffer, raw = allocate(size)
    read = FileRead(path, size, chunk_pieces(raw, crcs, chunk_bytes), pool or shared_pool())
    read.wait(timeout)
    return safetensors_views(buffer, raw, path)
