"""Layer streaming: run an mlx-lm model with only some decoder layers resident.

`load_prepared` builds the model of a prepared directory (engine/prepare.py),
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .config import EngineConfig
from .loader import LoadedModel, ModelLoadError, context_length_of
from .prepare import NON_LAYER_FILE, find_layers, read_manifest, verify_files
from .residency import ResidencyManager, ResidencyPlan, ShedEvent, fmt_bytes, plan_residency

log = logging.getLogger(__name__)

# One stream per thread (an MLX stream may only be used on the thread that made it).
IO_STREAM = mx.new_thread_local_stream(mx.cpu)

_EMPTY = mx.zeros((0,))
mx.eval(_EMPTY)  # concrete, so no thread ever has to evaluate it


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
class _Slot:
    container: Any  # the module or list holding the parameter
    key: Any
    name: str  # relative to the layer


@dataclass
class _LayerInfo:
    index: int
    module: nn.Module
    file: Path
    tensors: list[str]  # full names in the layer file
    experts_file: Path | None
    switches: list[dict]  # manifest switch layouts
    slots: list[_Slot]
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
    layers: list[_LayerInfo]
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
                    slot.container[slot.key] = _EMPTY
        mx.clear_cache()

    def _installed(self, info: _LayerInfo) -> bool:
        return all(
            slot.container[slot.key] is not _EMPTY
            for slot in info.slots
            if self.experts_with_layers or not self._is_expert_slot(info, slot.name)
        )

    def _reorder(self) -> None:
        self._streamed = [i.index for i in self.layers if is_streamed(i.module)]
        with self._lock:
            for index in list(self._pending):
                if index not in self._streamed:
                    del self._pending[index]

    def _make_resident(self, info: _LayerInfo) -> None:
        pending = self._load(info)
        self._install(info, pending.weights)
        mx.eval(list(pending.weights.values()))
        if is_streamed(info.module):
            info.module.__class__ = type(info.module)._fs_base

    def _make_streamed(self, info: _LayerInfo) -> None:
        self._release(info)
        if not is_streamed(info.module):
            info.module.__class__ = _streamed_class(type(info.module))
        info.module._fs_streamer = self

    # --- weights -----------------------------------------------------------

    def _is_expert_slot(self, info: _LayerInfo, name: str) -> bool:
        lp = f"{self.prefix}{info.index}."
        return any(f"{lp}{name}".startswith(sw["path"] + ".") for sw in info.switches)

    def _load(self, info: _LayerInfo) -> _Pending:
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

    def _install(self, info: _LayerInfo, weights: dict[str, mx.array]) -> None:
        for slot in info.slots:
            value = weights.get(slot.name)
            if value is None:
                if not self.experts_with_layers and self._is_expert_slot(info, slot.name):
                    continue
                raise ModelLoadError(
                    f"{info.file}: no tensor {self.prefix}{info.index}.{slot.name}"
                )
            slot.container[slot.key] = value

    def _release(self, info: _LayerInfo) -> None:
        for slot in info.slots:
            slot.container[slot.key] = _EMPTY

    # --- execution ---------------------------------------------------------

    def _prefetch(self, info: _LayerInfo) -> _Pending:
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

    def _run(self, layer: nn.Module, args: tuple, kwargs: dict) -> Any:
        start = time.perf_counter()
        info = self.layers[layer._fs_index]
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
        try:
            out = type(layer)._fs_base.__call__(layer, *args, **kwargs)
            # The one sync point: the output and the cache state must be
            # computed before the weights can go (lazy cache updates, e.g. a
            # recurrent state, would otherwise keep the weights alive).
            mx.eval(out, _cache_arrays(args, kwargs))
        finally:
            self._release(info)
            if self.drop_page_cache:
                _evict(info.file)
                if info.experts_file is not None and self.experts_with_layers:
                    _evict(info.experts_file)
        self.stats.streamed_calls += 1
        self.stats.streamed_seconds += time.perf_counter() - start
        return out

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


# --- building ---------------------------------------------------------------


def _slots(layer: nn.Module) -> list[_Slot]:
    slots = []
    for name, _ in tree_flatten(layer.parameters()):
        container: Any = layer
        *path, last = name.split(".")
        for part in path:
            container = container[int(part)] if isinstance(container, list) else container[part]
        key = int(last) if isinstance(container, list) else last
        slots.append(_Slot(container, key, name))
    return slots


def _layer_info(root: Path, entry: dict, module: nn.Module, prefix: str) -> _LayerInfo:
    index = entry["index"]
    slots = _slots(module)
    experts = entry.get("experts") or {}
    switches = experts.get("switches", [])
    lp = f"{prefix}{index}."
    have = {n[len(lp) :] for n in entry["tensors"]}
    for sw in switches:
        have |= {f"{sw['path'][len(lp) :]}.{name}" for name in sw["tensors"]}
    want = {s.name for s in slots}
    if have != want:
        missing = sorted(want - have)[:3]
        extra = sorted(have - want)[:3]
        raise ModelLoadError(
            f"{root / entry['file']}: tensors do not match the model "
            f"(missing {missing}, unexpected {extra})"
        )
    return _LayerInfo(
        index=index,
        module=module,
        file=root / entry["file"],
        tensors=list(entry["tensors"]),
        experts_file=root / experts["file"] if experts else None,
        switches=switches,
        slots=slots,
        dense_bytes=int(entry["tensor_bytes"]),
        expert_bytes=int(experts.get("tensor_bytes", 0)),
    )


def _build_model(root: Path, manifest: dict) -> tuple[nn.Module, dict]:
    from mlx_lm.utils import _get_classes, load_config

    config = load_config(root)
    try:
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
    except Exception as exc:
        raise ModelLoadError(
            f"{root}: cannot build model {config.get('model_type')}: {exc}"
        ) from exc
    quant = manifest["quantization"]["modules"]
    if quant:
        nn.quantize(
            model, class_predicate=lambda path, _: dict(quant[path]) if path in quant else False
        )
    model.eval()
    return model, config


def _load_non_layer(root: Path, model: nn.Module, prefix: str) -> int:
    file = root / NON_LAYER_FILE
    weights = mx.load(str(file))
    expected = {n: a for n, a in tree_flatten(model.parameters()) if not n.startswith(prefix)}
    if set(weights) != set(expected):
        missing = sorted(set(expected) - set(weights))[:3]
        extra = sorted(set(weights) - set(expected))[:3]
        raise ModelLoadError(
            f"{file}: tensors do not match the model (missing {missing}, unexpected {extra})"
        )
    for name, arr in weights.items():
        if arr.shape != expected[name].shape:
            raise ModelLoadError(
                f"{file}: {name} has shape {arr.shape}, the model expects {expected[name].shape}"
            )
    model.load_weights(list(weights.items()), strict=False)
    mx.eval(list(weights.values()))
    return sum(a.nbytes for a in weights.values())


def kv_bytes_per_token(model: nn.Module, config: dict) -> int:
    """KV cache bytes per token: attention layers x 2 x kv_heads x head_dim x 4 (float32).

    Attention layers are counted from the model's own cache layout, so hybrid
    models (linear-attention layers with constant-size state) count only
    their full-attention layers.
    """
    from mlx_lm.models.cache import make_prompt_cache

    text = config.get("text_config") or {}

    def get(key: str, default: Any = None) -> Any:
        return config.get(key, text.get(key, default))

    heads = int(get("num_attention_heads", 1) or 1)
    kv_heads = int(get("num_key_value_heads", heads) or heads)
    head_dim = get("head_dim") or int(get("hidden_size", 0)) // heads
    try:
        caches = make_prompt_cache(model)
        attention = sum(1 for c in caches if "KVCache" in type(c).__name__)
    except Exception:  # a model whose cache needs more than its config
        attention = int(get("num_hidden_layers", 0))
    return attention * 2 * kv_heads * int(head_dim) * 4


def runtime_reserve(config: dict, engine: EngineConfig) -> int:
    """R_runtime: memory for activations and the MLX runtime beyond weights and KV.

    A base for buffers and fragmentation, plus a prefill chunk's attention
    scores and activations, plus logits for a full batch. An estimate; set
    `extra["runtime_reserve"]` (bytes) to use a measured one.
    """
    if "runtime_reserve" in engine.extra:
        return int(engine.extra["runtime_reserve"])
    text = config.get("text_config") or {}
    hidden = int(config.get("hidden_size", text.get("hidden_size", 4096)))
    heads = int(config.get("num_attention_heads", text.get("num_attention_heads", 32)))
    vocab = int(config.get("vocab_size", text.get("vocab_size", 32000)))
    step = int(engine.prefill_step_size)
    activations = step * hidden * 4 * 16 + heads * step * step * 4 * 2
    logits = engine.max_batch * vocab * 4 * 4
    return 256 * 1024 * 1024 + activations + logits


def load_prepared(path: Path, config: EngineConfig) -> LoadedModel:
    """Load a prepared directory with the residency `config` asks for."""
    from mlx_lm.utils import load_tokenizer

    root = Path(path)
    manifest = read_manifest(root)
    verify_files(root, manifest)
    model, model_config = _build_model(root, manifest)
    layers, prefix = find_layers(model)
    if prefix != manifest["layers_prefix"] or len(layers) != manifest["num_layers"]:
        raise ModelLoadError(
            f"{root}: model has {len(layers)} layers under {prefix!r}, manifest says "
            f"{manifest['num_layers']} under {manifest['layers_prefix']!r}"
        )
    infos = [
        _layer_info(root, entry, layers[entry["index"]], prefix) for entry in manifest["layers"]
    ]
    for info in infos:  # drop the random initial weights before anything evaluates them
        for slot in info.slots:
            slot.container[slot.key] = _EMPTY
        info.module._fs_index = info.index
        info.module._fs_streamer = None
    non_layer_bytes = _load_non_layer(root, model, prefix)

    streamer = LayerStreamer(
        model=model,
        root=root,
        manifest=manifest,
        prefix=prefix,
        layers=infos,
        non_layer_bytes=non_layer_bytes,
        prefetch_depth=max(0, int(config.prefetch_depth)),
        drop_page_cache=bool(config.extra.get("stream_drop_page_cache", False)),
    )
    if config.expert_cache:
        # The expert cache owns the experts (engine/expert_offload.py): layers
        # are planned and streamed without them.
        streamer.detach_experts()
    context_length = context_length_of(model_config)
    plan = plan_residency(
        config,
        layer_bytes=[streamer.layer_bytes(i) for i in range(len(infos))],
        non_layer_bytes=non_layer_bytes,
        kv_bytes_per_token=kv_bytes_per_token(model, model_config),
        context_length=context_length,
        runtime_reserve=runtime_reserve(model_config, config),
    )
    log.info(plan.describe())
    streamer.plan = plan
    streamer.apply(plan.resident_layers)
    streamer.residency = ResidencyManager(
        demote=streamer.demote,
        resident=lambda: streamer.resident_layers,
        floor=int(config.shed_floor),
    )
    experts = None
    if config.expert_cache:
        from .expert_offload import offload_from_config

        experts = offload_from_config(model, root, manifest, config, model_config)
        streamer.residency.add_pressure_hook(experts.shrink)
    try:
        tokenizer = load_tokenizer(root, eos_token_ids=model_config.get("eos_token_id"))
    except Exception as exc:
        raise ModelLoadError(f"{root}: cannot load tokenizer: {exc}") from exc
    log.info(
        "loaded prepared model %s: %d/%d layers resident, %s resident weights",
        root,
        len(plan.resident_layers),
        len(infos),
        fmt_bytes(streamer.snapshot()["resident_weight_bytes"]),
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=model_config,
        model_id=config.model_id or root.name,
        path=root,
        context_length=context_length,
        streamer=streamer,
        experts=experts,
    )
