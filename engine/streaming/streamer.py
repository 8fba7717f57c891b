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
* Reads run on a dedicated MLX CPU stream (`IO_STREAM`, one per thread):
  `mx.load` of a safetensors file is lazy, and evaluating it on its own stream
  reads the file on that stream's thread, into the final buffers (no copies),
  while the compute stream runs the layers before. `prefetch_depth` layers
  ahead are kept in flight, cyclically, so the first streamed layer of the
  next token loads while the last layers and the LM head run.
* KV caches and recurrent state live in the cache list outside the layers, so
  they survive the weights being released.
* MoE experts travel with their layer (re-stacked from the per-expert records
  of experts/layer_XXXX.safetensors) until an expert cache takes them over
  (`LayerStreamer.detach_experts`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from flashserve.engine.streaming.residency import ResidencyManager, ResidencyPlan, ShedEvent
from flashserve.engine.weights.model import ModelLoadError

log = logging.getLogger(__name__)

# One stream per thread (an MLX stream may only be used on the thread that made it).
IO_STREAM = mx.new_thread_local_stream(mx.cpu)

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
    tensors: list[str]  # full names in the layer file
    experts_file: Path | None
    switches: list[dict]  # manifest switch layouts
    slots: list[Slot]
    dense_bytes: int
    expert_bytes: int


@dataclass
class _Pending:
    index: int
    weights: dict[str, mx.array]  # relative name -> array (lazy until read)
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
    experts_with_layers: bool = True
    # Evict a streamed layer's file from the page cache after each use: an
    # honest cold read every token (benchmarks; models far larger than RAM).
    drop_page_cache: bool = False
    plan: ResidencyPlan | None = None
    residency: ResidencyManager | None = None
    stats: StreamStats = field(default_factory=StreamStats)
    _streamed: list[int] = field(default_factory=list)  # in execution order
    _pending: dict[int, _Pending] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _held: int | None = None  # the layer `holding` keeps installed

    # --- residency ---------------------------------------------------------

    def layer_bytes(self, index: int) -> int:
        info = self.layers[index]
        return info.dense_bytes + (info.expert_bytes if self.experts_with_layers else 0)

    @property
    def resident_layers(self) -> list[int]:
        return [i.index for i in self.layers if not is_streamed(i.module)]

    @property
    def streamed_layers(self) -> list[int]:
        return list(self._streamed)

    def apply(self, resident: list[int]) -> None:
        """Make exactly `resident` layers resident, stream the others."""
        keep = set(resident)
        for info in self.layers:
            if info.index in keep:
                if is_streamed(info.module) or not self._installed(info):
                    self._make_resident(info)
            else:
                self._make_streamed(info)
        self._reorder()

    def demote(self, indices: list[int]) -> None:
        """Turn resident layers into streamed ones and return their memory."""
        for i in indices:
            self._make_streamed(self.layers[i])
        self._reorder()
        self.drop_prefetched()
        mx.clear_cache()

    def drop_prefetched(self) -> None:
        """Forget prefetched layers (frees their buffers once no computation uses them)."""
        with self._lock:
            self._pending.clear()

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

    def _make_resident(self, info: LayerInfo) -> None:
        pending = self._load(info)
        self._install(info, pending.weights)
        mx.eval(list(pending.weights.values()))
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

    def _load(self, info: LayerInfo) -> _Pending:
        """Start reading layer `info` on the I/O stream; returns lazy arrays."""
        lp = f"{self.prefix}{info.index}."
        try:
            loaded = mx.load(str(info.file), stream=IO_STREAM)
        except Exception as exc:  # a file changed or vanished under us
            raise ModelLoadError(f"{info.file}: cannot read layer weights: {exc}") from exc
        weights = {name[len(lp) :]: arr for name, arr in loaded.items()}
        nbytes = info.dense_bytes
        if info.switches and self.experts_with_layers:
            experts = mx.load(str(info.experts_file), stream=IO_STREAM)
            for sw in info.switches:
                rel = sw["path"][len(lp) :]
                count = sw["num_experts"]
                for name in sw["tensors"]:
                    parts = [experts[f"{sw['path']}.{e:04d}.{name}"] for e in range(count)]
                    weights[f"{rel}.{name}"] = mx.stack(parts, stream=IO_STREAM)
            nbytes += info.expert_bytes
        return _Pending(info.index, weights, nbytes)

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
        mx.async_eval(list(pending.weights.values()))
        self.stats.layer_loads += 1
        self.stats.bytes_read += pending.nbytes
        return pending

    def _schedule_after(self, index: int) -> None:
        order = self._streamed
        if not order or self.prefetch_depth <= 0:
            return
        pos = order.index(index)
        depth = min(self.prefetch_depth, len(order) - 1)
        for k in range(1, depth + 1):
            nxt = order[(pos + k) % len(order)]
            if nxt not in self._pending:
                self._pending[nxt] = self._prefetch(self.layers[nxt])

    def _acquire(self, info: LayerInfo) -> None:
        """Install layer `info`'s weights: the prefetched read, or a read now."""
        with self._lock:
            pending = self._pending.pop(info.index, None)
            if pending is None:
                pending = self._prefetch(info)
                self.stats.sync_loads += 1
            else:
                self.stats.prefetch_hits += 1
            self._install(info, pending.weights)
            del pending
            self._schedule_after(info.index)

    def _drop(self, info: LayerInfo) -> None:
        self._release(info)
        if self.drop_page_cache:
            _evict(info.file)
            if info.experts_file is not None and self.experts_with_layers:
                _evict(info.experts_file)

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
        try:
            out = self._call(layer, args, kwargs)
        finally:
            self._drop(info)
        self.stats.streamed_seconds += time.perf_counter() - start
        return out

    @contextmanager
    def holding(self, index: int) -> Iterator[None]:
        """Keep streamed layer `index` installed while the block runs.

        Layer-major prefill (generation/prefill.py) runs every chunk of a
        prompt through the layer inside the block: one read of the layer
        for the whole prompt instead of one per chunk.
        """
        start = time.perf_counter()
        info = self.layers[index]
        self._acquire(info)
        self._held = index
        try:
            yield
        finally:
            self._held = None
            self._drop(info)
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
            "resident_weight_bytes": self.non_layer_bytes
            + sum(self.layer_bytes(i) for i in resident),
            "non_layer_bytes": self.non_layer_bytes,
            "streaming_buffer_bytes": in_flight,
            "shedding_events": [
                asdict(e) for e in (self.residency.events if self.residency else [])
            ],
            "plan": self.plan.to_dict() if self.plan else None,
            "stats": asdict(self.stats),
        }


def _evict(path: Path) -> None:
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


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
