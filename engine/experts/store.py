"""The expert store: read one expert's weights from a prepared directory.

`flashserve prepare` writes experts/layer_XXXX.safetensors with every expert's
tensors (gate / up / down weights, scales, biases) as one contiguous record and
records each record's byte range in manifest.json (see engine/weights/prepare.py). So
one expert is one `os.preadv` — no mmap, no per-tensor seeks — issued on a
pool of daemon threads (weights/reader.py's ReadPool: the read releases the
GIL, so reads overlap with each other and with MLX compute on the worker
thread, and a read stuck on hung storage never holds up the process's exit).
Waiting for a read is bounded by `io_timeout`: the future's `result()` then
raises an ExpertReadError naming the file.

Bytes land in memory exactly once: the worker thread allocates an MLX uint8
buffer of the record's size, the I/O thread reads the file straight into it
(through numpy's view of the buffer), and each tensor becomes a zero-copy view
(slice → dtype view → reshape) of that buffer: prepare puts each tensor at a
multiple of 256 bytes in its record (weights/layout.py ALIGN), which every
backend's kernels accept. MLX calls stay on the worker
thread; I/O threads only run the syscall and a checksum.

Reads bypass the page cache where the system allows (O_DIRECT on Linux,
F_NOCACHE on macOS): an expert is read into the cache's own buffer anyway, so
a page-cache copy is memory held twice, charged to a memory cgroup and
reclaimed at a cost. Measured on the cap bench's experts (4 readers, 2.9 MB
records): the same throughput with 1/7 of the system CPU time. O_DIRECT wants
offsets, lengths and addresses on a block boundary: a buffer is a few pages
longer than its record, the read covers the aligned span around the record,
and the record is a view inside it (ReadResult.record).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from flashserve.engine.compute import qmm
from flashserve.engine.weights.checksum import crc32
from flashserve.engine.weights.reader import (
    DIRECT_ALIGN,
    ReadPool,
    WeightFileError,
    can_view,
    open_direct,
)

log = logging.getLogger(__name__)


class ExpertReadError(RuntimeError):
    """An expert record that cannot be read (truncated, corrupted or stalled file)."""


class _TimedRead(Future):
    """A read's future whose result() waits at most the store's io_timeout by default."""

    def __init__(self, timeout: float, what: str) -> None:
        super().__init__()
        self._timeout = timeout
        self._what = what

    def result(self, timeout: float | None = None) -> Any:
        try:
            return super().result(self._timeout if timeout is None else timeout)
        except FutureTimeout:
            raise ExpertReadError(
                f"{self._what}: read stalled (not done after {self._timeout:g} s, io_timeout); "
                "the storage under it may be hung"
            ) from None


@dataclass(frozen=True)
class TensorSpec:
    name: str  # relative to the switch, e.g. "gate_proj.weight"
    dtype: mx.Dtype
    shape: tuple[int, ...]
    offset: int  # within the record
    nbytes: int


@dataclass(frozen=True)
class SwitchLayout:
    """Where one MoE layer's experts live on disk."""

    layer: int
    path: str  # parameter path of the SwitchGLU, e.g. "model.layers.3.mlp.switch_mlp"
    file: Path
    num_experts: int
    record_bytes: int
    tensors: tuple[TensorSpec, ...]
    records: tuple[tuple[int, int], ...]  # per expert: (absolute offset, length)
    crc32: tuple[int, ...] | None  # per expert, when the manifest has checksums


@dataclass
class CachedExpert:
    """An expert in memory: its record as read, and its tensors as views of the record."""

    buffer: mx.array | None  # uint8, the whole record; None: views of a slab (all cached)
    tensors: dict[str, mx.array]


@dataclass
class ReadResult:
    buffer: mx.array  # uint8, what was allocated for the read (recycle this one)
    record: mx.array  # uint8, the record: a view of `buffer`
    nbytes: int
    seconds: float  # wall time of the read on its I/O thread


@dataclass(frozen=True)
class _Span:
    """One record's read: `size` bytes of the file from `file_offset` into the
    buffer at `buffer_at`; the record itself is at `record_at`, `length` long."""

    file_offset: int
    buffer_at: int
    size: int
    record_at: int
    length: int


def read_span(fd: int, target: memoryview, span: _Span, path: Path) -> None:
    """Fill the span. An aligned span may end past the end of the file: the read
    then stops short once the record is in (O_DIRECT reads end at EOF)."""
    need = span.record_at + span.length - span.buffer_at  # bytes up to the record's end
    got = 0
    while got < need:
        n = os.preadv(
            fd, [target[span.buffer_at + got : span.buffer_at + span.size]], span.file_offset + got
        )
        if n == 0:
            end = span.file_offset + got
            raise WeightFileError(f"{path}: ends at byte {end} (truncated; prepare it again)")
        got += n


def _evict(fd: int, offset: int, length: int, _: Future) -> None:
    with suppress(OSError):  # the store was closed meanwhile
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _dtype(name: str) -> mx.Dtype:
    dtype = getattr(mx, name, None)
    if not isinstance(dtype, mx.Dtype):
        raise ValueError(f"unknown dtype {name!r} in manifest")
    return dtype


def layouts_from_manifest(root: Path, manifest: dict) -> dict[int, SwitchLayout]:
    """One SwitchLayout per MoE layer of a prepared directory's manifest."""
    out: dict[int, SwitchLayout] = {}
    for layer in manifest["layers"]:
        experts = layer.get("experts")
        if not experts:
            continue
        switches = experts["switches"]
        if len(switches) != 1:
            raise ValueError(
                f"layer {layer['index']}: {len(switches)} expert blocks in one layer "
                "(the expert cache supports one)"
            )
        sw = switches[0]
        tensors = tuple(
            TensorSpec(
                name=name,
                dtype=_dtype(spec["dtype"]),
                shape=tuple(spec["shape"]),
                offset=int(spec["offset"]),
                nbytes=int(spec["nbytes"]),
            )
            for name, spec in sorted(sw["tensors"].items(), key=lambda kv: kv[1]["offset"])
        )
        crc = sw.get("crc32")
        out[int(layer["index"])] = SwitchLayout(
            layer=int(layer["index"]),
            path=sw["path"],
            file=Path(root) / experts["file"],
            num_experts=int(sw["num_experts"]),
            record_bytes=int(sw["record_bytes"]),
            tensors=tensors,
            records=tuple((int(o), int(n)) for o, n in sw["records"]),
            crc32=tuple(int(c) for c in crc) if crc else None,
        )
    return out


class ExpertStore:
    """Parallel pread of expert records; one open file descriptor per MoE layer."""

    def __init__(
        self,
        layouts: dict[int, SwitchLayout],
        threads: int = 8,
        verify: bool = True,
        drop_page_cache: bool = False,
        io_timeout: float = 30.0,
    ) -> None:
        if threads < 1:
            raise ValueError("expert_threads must be >= 1")
        self.layouts = layouts
        self.verify = verify
        self.io_timeout = io_timeout
        # Evict each record from the page cache once read: every read of it
        # then comes from disk, as for a model far larger than RAM (benchmarks).
        self.drop_page_cache = drop_page_cache and hasattr(os, "posix_fadvise")
        self._fds: dict[int, int] = {}
        self._aligned: dict[int, bool] = {}  # layer -> its reads are O_DIRECT
        direct = mx.default_device() == mx.cpu
        self._lock = threading.Lock()
        self._pool = ReadPool(threads, "expert-io")
        self.threads = threads
        self._free: dict[int, list[mx.array]] = {}  # buffer length -> reusable buffers
        self.max_free = 64
        for layer, layout in layouts.items():
            fd, self._aligned[layer] = open_direct(layout.file, direct)
            self._fds[layer] = fd
            if hasattr(os, "posix_fadvise") and not self._aligned[layer]:
                # Records are read whole and at random; kernel readahead would
                # pull in neighbouring experts nobody asked for.
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            size = os.fstat(fd).st_size
            end = max(o + n for o, n in layout.records)
            if size < end:
                first_bad = next(e for e, (o, n) in enumerate(layout.records) if o + n > size)
                log.warning(
                    "%s is truncated (%d of %d bytes): experts %d.. of layer %d cannot be read",
                    layout.file,
                    size,
                    end,
                    first_bad,
                    layer,
                )

    def expert_bytes(self, layer: int) -> int:
        return self.layouts[layer].record_bytes

    def check(self, layer: int, expert: int) -> None:
        layout = self.layouts.get(layer)
        if layout is None:
            raise ExpertReadError(f"layer {layer} has no experts on disk")
        if not 0 <= expert < layout.num_experts:
            raise ExpertReadError(
                f"layer {layer}: expert {expert} out of range (0..{layout.num_experts - 1})"
            )

    def _buffers(self, lengths: list[int]) -> list[mx.array]:
        """Record buffers: recycled ones first, then fresh ones.

        A fresh one comes unwritten from flashserve's extension on the CPU: its
        pages are faulted in by the read, on the I/O thread. Else it is
        zero-filled on the MLX stream (one sync for all), which waits behind
        the ops queued there: in a cold prefill, every read while the cache
        fills waited for the experts computing before it.
        """
        out: list[mx.array | None] = []
        fresh = []
        ext = qmm.extension() if mx.default_device() == mx.cpu else None
        make = getattr(ext, "uninitialized_bytes", None)  # an extension built before it has none
        for length in lengths:
            pool = self._free.get(length)
            if pool:
                out.append(pool.pop())
            elif make is not None:
                out.append(make(length))
            else:
                buffer = mx.zeros((length,), dtype=mx.uint8)
                fresh.append(buffer)
                out.append(buffer)
        if fresh:
            mx.eval(fresh)
        return out  # type: ignore[return-value]

    def recycle(self, buffer: mx.array) -> None:
        """Take back the buffer of an evicted expert, to read the next one into.

        Only for buffers no pending computation reads any more: the offload
        evicts right after a layer's sync, when every earlier layer has run.
        Reusing them saves allocating and faulting in a buffer per miss.
        """
        pool = self._free.setdefault(buffer.size, [])
        if len(pool) < self.max_free:
            pool.append(buffer)

    def drop_free(self, keep: int = 0) -> None:
        """Free the spare buffers, keeping at most `keep` of each buffer length."""
        for pool in self._free.values():
            del pool[keep:]

    def submit(self, layer: int, expert: int) -> Future[ReadResult]:
        """Start reading one expert. Call on the thread that runs MLX (allocates)."""
        return self.submit_many([(layer, expert)])[0]

    def submit_many(self, keys: list[tuple[int, int]]) -> list[Future[ReadResult]]:
        """Start reading several experts, in order (the pool is FIFO)."""
        for layer, expert in keys:
            self.check(layer, expert)
        lengths = [self._buffer_length(*key) for key in keys]
        buffers = self._buffers(lengths)
        futures = []
        for (layer, expert), buffer in zip(keys, buffers, strict=True):
            offset, length = self.layouts[layer].records[expert]
            target = np.array(buffer, copy=False)  # writable view of MLX's memory
            span = self._span(layer, offset, length, target.ctypes.data)
            record = buffer if span.record_at == 0 else buffer[span.record_at :][:length]
            what = f"expert {expert} of layer {layer} ({self.layouts[layer].file})"
            future = _TimedRead(self.io_timeout, what)
            if self.drop_page_cache and not self._aligned[layer]:
                # Benchmarks: every read comes from disk. The eviction runs on the
                # I/O thread once the result is out, so no waiter waits for it.
                future.add_done_callback(partial(_evict, self._fds[layer], offset, length))
            self._pool.submit(
                self._read, layer, expert, buffer, record, target, span, future=future
            )
            futures.append(future)
        return futures

    def _buffer_length(self, layer: int, expert: int) -> int:
        length = self.layouts[layer].records[expert][1]
        # Room to start the read on a block boundary and end it on one.
        return length + 3 * DIRECT_ALIGN if self._aligned[layer] else length

    def _span(self, layer: int, offset: int, length: int, address: int) -> _Span:
        """Where one record's read goes in its buffer (see the module doc)."""
        if not self._aligned[layer]:
            return _Span(offset, 0, length, 0, length)
        start = offset - offset % DIRECT_ALIGN
        end = -(-(offset + length) // DIRECT_ALIGN) * DIRECT_ALIGN
        at = -address % DIRECT_ALIGN
        return _Span(start, at, end - start, at + offset - start, length)

    def _read(
        self,
        layer: int,
        expert: int,
        buffer: mx.array,
        record: mx.array,
        target: np.ndarray,
        span: _Span,
    ) -> ReadResult:
        layout = self.layouts[layer]
        start = time.perf_counter()
        fd = self._fds[layer]
        offset = span.file_offset + span.record_at - span.buffer_at
        what = f"expert {expert} of layer {layer}"
        try:
            read_span(fd, memoryview(target), span, Path(layout.file))
        except WeightFileError as exc:
            raise ExpertReadError(
                f"{what}: {exc}; the record needs bytes {offset}..{offset + span.length}"
            ) from None
        except OSError as exc:
            raise ExpertReadError(f"{what}: cannot read {layout.file}: {exc}") from exc
        view = memoryview(target)[span.record_at : span.record_at + span.length]
        if self.verify and layout.crc32 is not None and crc32(view) != layout.crc32[expert]:
            raise ExpertReadError(
                f"expert {expert} of layer {layer}: checksum mismatch in {layout.file} "
                f"bytes {offset}..{offset + span.length} (file corrupted; prepare the model again)"
            )
        return ReadResult(buffer, record, span.length, time.perf_counter() - start)

    def tensors(self, layer: int, buffer: mx.array) -> dict[str, mx.array]:
        """Zero-copy views of one record's tensors (not yet evaluated)."""
        out = {}
        for spec in self.layouts[layer].tensors:
            raw = buffer[spec.offset : spec.offset + spec.nbytes]
            if not can_view(spec.offset, spec.dtype):
                raw = mx.array(np.array(raw))  # misaligned for this backend: a copy, not a view
            out[spec.name] = raw.view(spec.dtype).reshape(spec.shape)
        return out

    def read(self, layer: int, expert: int) -> dict[str, mx.array]:
        """Synchronous read of one expert (tests, tools)."""
        result = self.submit(layer, expert).result()
        arrays = self.tensors(layer, result.record)
        mx.eval(arrays)
        return arrays

    def close(self) -> None:
        stopped = self._pool.close()
        self._free.clear()
        if not stopped:
            # A read is stuck in the kernel: its descriptor must stay open (a reused
            # number would be read by it); the process is ending anyway.
            log.warning("an expert read is stuck; its files stay open")
            return
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
