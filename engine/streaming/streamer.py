"""Layer streaming: run an mlx-lm model with only some decoder layers resident.

`load_prepared` (streaming/prepared.py) builds the model of a prepared directory,
keeps the non-layer weights and the planned resident layers in memory, and
turns every other decoder layer into a streamed layer:

* A streamed layer is the same module object, re-classed to a subclass that
  also derives from `StreamedLayer` (so `isinstance(layer, StreamedLayer)`).
  Every attribute the model reads from its layers (`is_linear`, `self_attn`,
  ...) stays where it was, parameter names are unchanged, and no model code is
  copied. Its parameters hold empty placeholders while it is not running.
* Calling it installs the layer's weights (prefetched, or read now), runs the
  real layer, evaluates the output and the layer's cache state, then puts the
  placeholders back so the weights are freed. That evaluation is the only
  synchronization streaming adds; resident layers are untouched modules, so a
  fully resident model runs exactly the plain mlx-lm path.
* Reads run on the `layer-io` pool (weights/reader.py): `os.preadv` of 4 MiB
  chunks in parallel, straight into one MLX buffer per file, each chunk
  checked against its CRC32 in the manifest as it lands. The tensors are
  views of that buffer. The syscall releases the GIL, so the compute stream
  runs the layers before meanwhile, and a hung disk freezes nothing but the
  request that waits for it: past `io_timeout` seconds without progress the
  wait fails, naming the file. `prefetch_depth` layers ahead are kept in
  flight, cyclically, so the first streamed layer of the next token loads
  while the last layers and the LM head run. A layer's buffer is read into
  again by a later load once the layer has run (no allocation per token).
* KV caches and recurrent state live in the cache list outside the layers, so
  they survive the weights being released.
* MoE experts travel with their layer until an expert cache takes them over
  (`LayerStreamer.detach_experts`): each expert's record of
  experts/layer_XXXX.safetensors is read with one `preadv` scattered into the
  stacked tensors ([experts, ...]), and checked against the record's CRC32.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from flashserve.engine.compute import qmm
from flashserve.engine.streaming.residency import ResidencyManager, ResidencyPlan, ShedEvent
from flashserve.engine.weights import derived
from flashserve.engine.weights.derived import Derived
from flashserve.engine.weights.layout import expert_regions
from flashserve.engine.weights.model import ModelLoadError
from flashserve.engine.weights.reader import (
    CHUNK_BYTES,
    DIRECT_ALIGN,
    DIRECT_SLACK,
    FileRead,
    Piece,
    ReadPool,
    WeightFileError,
    allocate,
    chunk_pieces,
    direct_base,
    shared_pool,
    view_as,
)

log = logging.getLogger(__name__)

_SIZE_CLASS = 1 << 20  # streamed-layer buffers come in whole MiB (see _buffer)

EMPTY = mx.zeros((0,))
mx.eval(EMPTY)  # concrete, so no thread ever has to evaluate it


class StreamedLayer:
    """Mixin of every streamed layer's class; its __call__ goes through the streamer."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fs_streamer._run(self, args, kwargs)


_CLASSES: dict[type, type] = {}


def _streamed_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            f"Streamed{cls.__name__}", (StreamedLayer, cls), {"__slots__": (), "_fs_base": cls}
        )
    return _CLASSES[cls]


def is_streamed(layer: nn.Module) -> bool:
    return isinstance(layer, StreamedLayer)


@dataclass
class StreamStats:
    layer_loads: int = 0  # streamed-layer weight loads issued
    prefetch_hits: int = 0  # loads that were already in flight when the layer ran
    sync_loads: int = 0  # loads issued when the layer was needed
    bytes_read: int = 0
    streamed_calls: int = 0
    streamed_seconds: float = 0.0  # wall time in streamed layers: compute + waiting for reads


@dataclass
class Slot:
    container: Any  # the module or list holding the parameter
    key: Any
    name: str  # relative to the layer


@dataclass
class LayerInfo:
    index: int
    module: nn.Module
    file: Path
    tensors: list[str]  # full names of its dense tensors (those rebuilt after a read too)
    experts_file: Path | None
    switches: list[dict]  # manifest switch layouts
    slots: list[Slot]
    dense_bytes: int
    expert_bytes: int
    file_bytes: int = 0  # size of the layer file
    crc32: list[int] | None = None  # per checksum chunk; None: not verified (old manifest)
    experts_file_bytes: int = 0
    bytes_read: int = 0  # read from disk for this layer since start (the dashboard's strip)
    derived: list[Derived] = field(default_factory=list)  # rebuilt after the file's bytes
    derived_bytes: int = 0  # their region: ALIGN steps
    left_out_bytes: int = 0  # their own bytes: in the layer's dense bytes, not in its file


@dataclass
class _Read:
    """One file being read into `buffer` (raw: numpy's view of it, the pool writes there)."""

    job: FileRead
    buffer: mx.array
    raw: np.ndarray
    base: int = 0  # where the file starts in the buffer (a direct read's aligned start)


@dataclass
class _Pending:
    index: int
    dense: _Read
    experts: _Read | None  # the layer's stacked experts, while they travel with it
    nbytes: int


@dataclass
class LayerStreamer:
    """Streams the non-resident decoder layers of one model; see the module doc."""

    model: nn.Module
    root: Path
    manifest: dict
    prefix: str
    layers: list[LayerInfo]
    non_layer_bytes: int
    prefetch_depth: int = 1
    max_prefetch_depth: int = 1  # the configured depth (a memory plan may run with less)
    experts_with_layers: bool = True
    # Evict a streamed layer's file from the page cache after each use: an
    # honest cold read every token (benchmarks; models far larger than RAM).
    drop_page_cache: bool = False
    plan: ResidencyPlan | None = None
    residency: ResidencyManager | None = None
    # Layer files read around the page cache (O_DIRECT; F_NOCACHE on macOS): under
    # a memory plan every byte of the limit is planned, and a page-cache copy of
    # each streamed layer would be charged to it (and evict the libraries' code).
    direct_reads: bool = False
    # Seconds a read may make no progress before the layer's request fails.
    io_timeout: float = 30.0
    # Layers hold a 0-d `times` for the biases their scales give (weights/derived.py),
    # not the biases (a tenth of a Q4_0 layer): where every linear that has them
    # runs on the fast kernel, which reads them so (compute/qmm.py scaled_biases).
    scaled_biases: bool = False
    chunk_bytes: int = CHUNK_BYTES  # the manifest's checksum chunk
    pool: ReadPool = field(default_factory=shared_pool)
    stats: StreamStats = field(default_factory=StreamStats)
    _streamed: list[int] = field(default_factory=list)  # in execution order
    _pending: dict[int, _Pending] = field(default_factory=dict)
    _running: dict[int, _Pending] = field(default_factory=dict)  # installed streamed layers
    _last_read: Future | None = None  # the end of the streamed read queued last
    _free: dict[int, list[tuple[mx.array, np.ndarray]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _held: int | None = None  # the layer `holding` keeps installed
    # Layers resident on loan (streaming/lending.py): a streamed layer that has run
    # keeps its weights while `lend_room` bytes allow, and `give_back` streams it again.
    lend_room: int = 0
    lent: list[int] = field(default_factory=list)
    # Called (worker thread) whenever which layers stream changes, by name: a
    # compiled decode step holds the weights it was traced with
    # (generation/decode_step.py).
    residency_listeners: dict[str, Callable[[], None]] = field(default_factory=dict)
    # The dense plan's model shape and the configured (chunk, keep float copies):
    # a prefill's settings within the room it finds (streaming/lending.py)
    dense_shape: Any = None
    max_prefill: tuple[int, bool] | None = None
    planned_prefill: tuple[int, bool] | None = None  # what the plan left them at

    # --- residency ---------------------------------------------------------

    def layer_bytes(self, index: int) -> int:
        info = self.layers[index]
        dense = info.dense_bytes - (info.left_out_bytes if self.scaled_biases else 0)
        return dense + (info.expert_bytes if self.experts_with_layers else 0)

    @property
    def resident_layers(self) -> list[int]:
        return [i.index for i in self.layers if not is_streamed(i.module)]

    @property
    def streamed_layers(self) -> list[int]:
        return list(self._streamed)

    def apply(self, resident: list[int]) -> None:
        """Make exactly `resident` layers resident, stream the others."""
        keep = set(resident)
        self.lent, self.lend_room = [], 0
        for info in self.layers:
            if info.index in keep:
                if is_streamed(info.module) or not self._installed(info):
                    self._make_resident(info)
            else:
                self._make_streamed(info)
        self._reorder()

    def demote(self, indices: list[int]) -> None:
        """Turn resident layers into streamed ones and return their memory."""
        self.lent = [i for i in self.lent if i not in indices]
        for i in indices:
            self._make_streamed(self.layers[i])
        self._reorder()
        self.drop_prefetched()
        mx.clear_cache()

    def drop_prefetched(self) -> None:
        """Forget prefetched layers and spare buffers (freed once no read or computation
        uses them; a read still in flight keeps its buffer until it ends)."""
        with self._lock:
            self._pending.clear()
            self._free.clear()

    def detach_experts(self) -> None:
        """Stop carrying MoE experts with their layers (an expert cache owns them now).

        Resident experts are released; the SwitchGLU parameters keep placeholders
        until the expert cache replaces those modules.
        """
        self.drop_prefetched()
        self.experts_with_layers = False
        for info in self.layers:
            for slot in info.slots:
                if self._is_expert_slot(info, slot.name):
                    slot.container[slot.key] = EMPTY
        mx.clear_cache()

    def _installed(self, info: LayerInfo) -> bool:
        return all(
            slot.container[slot.key] is not EMPTY
            for slot in info.slots
            if self.experts_with_layers or not self._is_expert_slot(info, slot.name)
        )

    def _reorder(self) -> None:
        self._streamed = [i.index for i in self.layers if is_streamed(i.module)]
        with self._lock:
            for index in list(self._pending):
                if index not in self._streamed:
                    del self._pending[index]
        for listener in self.residency_listeners.values():
            listener()

    def _make_resident(self, info: LayerInfo) -> None:
        weights = self._weights(info, self._load(info, fresh=True))
        self._install(info, weights)
        mx.eval(list(weights.values()))
        if is_streamed(info.module):
            info.module.__class__ = type(info.module)._fs_base

    def _make_streamed(self, info: LayerInfo) -> None:
        self._release(info)
        if not is_streamed(info.module):
            info.module.__class__ = _streamed_class(type(info.module))
        info.module._fs_streamer = self

    # --- weights -----------------------------------------------------------

    def _is_expert_slot(self, info: LayerInfo, name: str) -> bool:
        lp = f"{self.prefix}{info.index}."
        return any(f"{lp}{name}".startswith(sw["path"] + ".") for sw in info.switches)

    def _load(self, info: LayerInfo, fresh: bool = False) -> _Pending:
        """Start reading layer `info` on the pool (MLX thread: it allocates).

        `fresh`: into new buffers (a resident layer keeps them), not recycled ones.
        """
        size = info.file_bytes
        direct = self.direct_reads
        extra = 0 if self.scaled_biases else derived.tail_bytes(size, info.derived_bytes)
        buffer, raw = self._buffer(size + (DIRECT_SLACK if direct else 0) + extra, fresh)
        base = direct_base(raw) if direct else 0
        end = base + (-(-size // DIRECT_ALIGN) * DIRECT_ALIGN if direct else size)
        pieces = chunk_pieces(raw[base:end], info.crc32, self.chunk_bytes, size)
        # A streamed layer's reads start as the last one queued ends (FileRead `after`).
        after = None if fresh else self._last_read
        job = self._read(info.file, size, pieces, direct=direct, after=after)
        dense = _Read(job, buffer, raw, base)
        experts = None
        nbytes = info.dense_bytes - info.left_out_bytes  # what is read
        if info.switches and self.experts_with_layers:
            experts = self._load_experts(info, fresh, after)
            nbytes += info.expert_bytes
        last = (experts or dense).job
        if not fresh:  # one that keeps the pool busy alone: small ones may overlap
            self._last_read = last.future if last.tasks >= self.pool.threads - 1 else None
        return _Pending(info.index, dense, experts, nbytes)

    def _read(self, path: Path, size: int, pieces: list[Piece], **kw: Any) -> FileRead:
        return FileRead(path, size, pieces, self.pool, drop_page_cache=self.drop_page_cache, **kw)

    def _load_experts(self, info: LayerInfo, fresh: bool, after: Any = None) -> _Read:
        """One preadv per expert record, scattered into the stacked tensors' regions."""
        assert info.experts_file is not None
        regions = expert_regions(info.switches)
        size = max((r[0] + r[1] * r[2]["num_experts"] for r in regions.values()), default=0)
        buffer, raw = self._buffer(size, fresh)
        view = memoryview(raw)
        pieces = []
        for sw in info.switches:
            crcs = sw.get("crc32")
            names = sorted(sw["tensors"], key=lambda n: sw["tensors"][n]["offset"])
            ends = [*(int(sw["tensors"][n]["offset"]) for n in names[1:]), sw["record_bytes"]]
            for e, (offset, _) in enumerate(sw["records"]):
                targets = []
                for name, end in zip(names, ends, strict=True):
                    base, nbytes, _ = regions[f"{sw['path']}.{name}"]
                    targets.append(view[base + e * nbytes : base + (e + 1) * nbytes])
                    gap = end - int(sw["tensors"][name]["offset"]) - nbytes
                    if gap:  # the record's alignment padding: read (and checked), not kept
                        targets.append(memoryview(bytearray(gap)))
                pieces.append(Piece(int(offset), targets, None if crcs is None else crcs[e]))
        job = self._read(info.experts_file, info.experts_file_bytes, pieces, after=after)
        return _Read(job, buffer, raw)

    def _weights(self, info: LayerInfo, pending: _Pending) -> dict[str, mx.array]:
        """Wait for layer `info`'s reads (io_timeout) and return its tensors by relative name."""
        lp = f"{self.prefix}{info.index}."
        dense = pending.dense
        dense.job.wait(self.io_timeout)
        weights = {}
        scaled = self.scaled_biases
        views = derived.layer_views(
            dense.buffer,
            dense.raw,
            dense.base,
            info.file,
            info.file_bytes,
            info.derived,
            not scaled,
        )
        if scaled:
            views |= {d.name: qmm.scaled_biases(d.times) for d in info.derived}
        for name, arr in views.items():
            if not name.startswith(lp):
                raise WeightFileError(f"{info.file}: tensor {name} is not of layer {info.index}")
            weights[name[len(lp) :]] = arr
        if pending.experts is not None:
            read = pending.experts
            read.job.wait(self.io_timeout)
            for path, (base, nbytes, sw) in expert_regions(info.switches).items():
                spec = sw["tensors"][path[len(sw["path"]) + 1 :]]
                dtype = getattr(mx, spec["dtype"])
                n = sw["num_experts"]
                shape = [n, *spec["shape"]]
                view = view_as(read.buffer, read.raw, base, base + n * nbytes, dtype, shape)
                weights[path[len(lp) :]] = view
        return weights

    def _buffer(self, size: int, fresh: bool) -> tuple[mx.array, np.ndarray]:
        """A buffer of at least `size` bytes: a spare one, else a new one.

        Streamed reads use size classes (whole MiB), so layer files that differ
        by a few header bytes share buffers. A miss frees the spares first: they
        are of another class, and keeping them would hold more than the plan's
        (prefetch_depth + 1) layer buffers.
        """
        if fresh:
            return allocate(size, self.direct_reads)
        size = -(-size // _SIZE_CLASS) * _SIZE_CLASS
        with self._lock:
            spare = self._free.get(size)
            if spare:
                return spare.pop()
            self._free.clear()
        return allocate(size, self.direct_reads)

    def _recycle(self, pending: _Pending) -> None:
        """Keep a run layer's buffers for the next loads (no allocation per token)."""
        with self._lock:
            for read in (pending.dense, pending.experts):
                if read is not None and read.job.future.done():
                    spare = self._free.setdefault(read.raw.size, [])
                    if len(spare) <= self.prefetch_depth:
                        spare.append((read.buffer, read.raw))

    def _install(self, info: LayerInfo, weights: dict[str, mx.array]) -> None:
        for slot in info.slots:
            value = weights.get(slot.name)
            if value is None:
                if not self.experts_with_layers and self._is_expert_slot(info, slot.name):
                    continue
                raise ModelLoadError(
                    f"{info.file}: no tensor {self.prefix}{info.index}.{slot.name}"
                )
            slot.container[slot.key] = value

    def _release(self, info: LayerInfo) -> None:
        for slot in info.slots:
            slot.container[slot.key] = EMPTY

    # --- execution ---------------------------------------------------------

    def _prefetch(self, info: LayerInfo) -> _Pending:
        pending = self._load(info)
        self.stats.layer_loads += 1
        self.stats.bytes_read += pending.nbytes
        info.bytes_read += pending.nbytes
        return pending

    def _schedule_after(self, index: int) -> None:
        order = self._streamed
        if not order or self.prefetch_depth <= 0:
            return
        pos = order.index(index)
        depth = min(self.prefetch_depth, len(order) - 1)
        for k in range(1, depth + 1):
            nxt = order[(pos + k) % len(order)]
            # Only this (the MLX) thread changes _pending; the lock is for snapshot().
            if nxt not in self._pending:
                pending = self._prefetch(self.layers[nxt])
                with self._lock:
                    self._pending[nxt] = pending

    def _acquire(self, info: LayerInfo) -> None:
        """Install layer `info`'s weights: the prefetched read, or a read now.

        The next layers' reads are queued before waiting for this one, so they
        overlap it. The wait is outside the lock: /memory never waits on a disk.
        """
        with self._lock:
            pending = self._pending.pop(info.index, None)
        if pending is None:
            pending = self._prefetch(info)
            self.stats.sync_loads += 1
        else:
            self.stats.prefetch_hits += 1
        self._schedule_after(info.index)
        weights = self._weights(info, pending)  # WeightFileError names the file
        self._install(info, weights)
        self._running[info.index] = pending

    def _drop(self, info: LayerInfo, ran: bool, lend: bool = True) -> None:
        """Release layer `info`; `ran`: its computation is evaluated, so its buffers
        can take the next reads (after a failure a lazy graph might still use them).
        `lend`: it may stay resident on loan instead (`lend_room`)."""
        if ran and lend and self._keep_on_loan(info):
            return
        self._release(info)
        pending = self._running.pop(info.index, None)
        if ran and pending is not None:
            self._recycle(pending)

    def _keep_on_loan(self, info: LayerInfo) -> bool:
        """Keep a layer that has just run resident, its weights where they were read,
        while the loan has room for it: no read of its own. First those after a
        streamed layer, so streamed layers stay spread: a read ahead overlaps a
        layer's compute or two, not a run of them (the disk would wait)."""
        nbytes = self.layer_bytes(info.index)
        if self.lend_room < nbytes or self._running.get(info.index) is None:
            return False
        streamed = set(self._streamed)  # past the room check: a full loan's steps skip it
        if info.index - 1 not in streamed and any(i - 1 in streamed for i in streamed):
            return False
        self._running.pop(info.index)
        info.module.__class__ = type(info.module)._fs_base
        self.lent.append(info.index)
        self.lend_room -= nbytes
        self._reorder()
        if not self._streamed:  # nothing streams now: no spare buffer is needed
            self.drop_prefetched()
        return True

    def give_back(self, count: int) -> None:
        """Stream the last `count` layers lent again (their memory goes back now)."""
        if count > 0 and self.lent:
            self.demote(self.lent[-count:])

    def _call(self, layer: nn.Module, args: tuple, kwargs: dict) -> Any:
        out = type(layer)._fs_base.__call__(layer, *args, **kwargs)
        # The one sync point: the output and the cache state must be
        # computed before the weights can go (lazy cache updates, e.g. a
        # recurrent state, would otherwise keep the weights alive).
        mx.eval(out, _cache_arrays(args, kwargs))
        self.stats.streamed_calls += 1
        return out

    def _run(self, layer: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self._held == layer._fs_index:
            return self._call(layer, args, kwargs)
        start = time.perf_counter()
        info = self.layers[layer._fs_index]
        self._acquire(info)
        ran = False
        try:
            out = self._call(layer, args, kwargs)
            ran = True
        finally:
            self._drop(info, ran)
        self.stats.streamed_seconds += time.perf_counter() - start
        return out

    @contextmanager
    def holding(self, index: int) -> Iterator[None]:
        """Keep streamed layer `index` installed while the block runs.

        Layer-major prefill (generation/prefill/layer_major.py) runs every chunk of a
        prompt through the layer inside the block: one read of the layer
        for the whole prompt instead of one per chunk.
        """
        start = time.perf_counter()
        info = self.layers[index]
        self._acquire(info)
        self._held = index
        ran = False
        try:
            yield
            ran = True  # the block evaluates what it ran through the layer
        finally:
            self._held = None
            self._drop(info, ran, lend=False)
            self.stats.streamed_seconds += time.perf_counter() - start

    # --- reporting ---------------------------------------------------------

    def on_tokens(self, count: int = 1) -> ShedEvent | None:
        """The worker's hook: call after each generated token (or batch of them);
        memory is checked every 64 tokens and layers shed under pressure."""
        return self.residency.on_tokens(count) if self.residency else None

    def check_memory(self) -> ShedEvent | None:
        """Check memory now and shed if under the floor (worker thread only)."""
        return self.residency.check() if self.residency else None

    def snapshot(self) -> dict:
        """Plain data for the memory report; safe to call from any thread."""
        resident = self.resident_layers
        with self._lock:
            in_flight = sum(p.nbytes for p in self._pending.values())
        return {
            "num_layers": len(self.layers),
            "resident_layers": resident,
            "streamed_layers": self.streamed_layers,
            "lent_layers": list(self.lent),
            "resident_weight_bytes": self.non_layer_bytes
            + sum(self.layer_bytes(i) for i in resident),
            "non_layer_bytes": self.non_layer_bytes,
            "streaming_buffer_bytes": in_flight,
            "layer_bytes_read": [info.bytes_read for info in self.layers],
            "shedding_events": [
                asdict(e) for e in (self.residency.events if self.residency else [])
            ],
            "plan": self.plan.to_dict() if self.plan else None,
            "stats": asdict(self.stats),
        }


def _cache_arrays(args: tuple, kwargs: dict) -> list[mx.array]:
    from mlx_lm.models.cache import _BaseCache

    found: list[mx.array] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, _BaseCache):
            try:
                state = value.state
            except Exception:  # an empty cache of some kinds raises
                continue
            found.extend(a for _, a in tree_flatten(state) if isinstance(a, mx.array))
    return found
