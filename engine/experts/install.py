"""Install the expert cache into a model: every SwitchGLU becomes an OffloadedSwitchGLU.

Reads the expert layouts from a prepared directory's manifest, checks that the
cache can hold one layer's top-k, keeps resident router copies for next-layer
prefetch, and builds the ExpertStore / ExpertCache / ExpertOffload trio
(experts/offload.py) that serves the calls.
"""

from __future__ import annotations

import copy
import itertools
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_unflatten

from flashserve.engine.config import EngineConfig
from flashserve.engine.experts.cache import (
    CacheCapacityError,
    Capacity,
    ExpertCache,
    Key,
    fmt_bytes,
    make_policy,
)
from flashserve.engine.experts.compute import EMPTY, OffloadLayer
from flashserve.engine.experts.offload import ExpertOffload
from flashserve.engine.experts.store import CachedExpert, ExpertStore, layouts_from_manifest
from flashserve.engine.experts.trace import RoutingTrace
from flashserve.engine.weights import derived
from flashserve.engine.weights.model import ModelLoadError

log = logging.getLogger(__name__)

ROUTER_NAMES = ("gate", "router")
TOP_K_NAMES = ("top_k", "num_experts_per_tok", "n_activated_experts")


class OffloadedSwitchGLU(nn.Module):
    """Drop-in for SwitchGLU: same call, experts fetched through the expert cache."""

    def __init__(self, offload: ExpertOffload, layer: int) -> None:
        super().__init__()
        # Plain attributes (not module children): no parameters show up in the
        # model tree, so nothing walks, saves, streams or quantizes the experts.
        object.__setattr__(self, "_offload", offload)
        object.__setattr__(self, "_layer", layer)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return self._offload.run(self._layer, x, indices)

    def set_prompt_xbits(self, xbits: int) -> None:
        """The model's `prompt_matmul` setting (compute/prompt_matmul.set_prompt_matmul),
        for the prefill's expert rows (experts/prompt_gemm.py); shared by every layer."""
        self._offload.prompt_xbits = xbits


# -- installation -----------------------------------------------------------------------


def _get(root: Any, path: str) -> Any:
    obj = root
    for part in path.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    return obj


def _top_k(block: nn.Module, config: dict) -> int:
    for name in TOP_K_NAMES:
        value = getattr(block, name, None)
        if isinstance(value, int) and value > 0:
            return value
    value = config.get("num_experts_per_tok") or (config.get("text_config") or {}).get(
        "num_experts_per_tok"
    )
    if not value:
        raise CacheCapacityError("cannot tell how many experts a token uses (top-k)")
    return int(value)


def _router_copy(
    block: nn.Module, block_path: str, num_experts: int, layer_weights: dict[str, mx.array]
) -> nn.Module | None:
    """A resident copy of the block's router, with its weights read from the layer file.

    The copy survives layer streaming releasing the block's own weights.
    """
    for name in ROUTER_NAMES:
        router = block.get(name) if isinstance(block, dict) else None
        if not isinstance(router, nn.Module):
            continue
        prefix = f"{block_path}.{name}."
        params = {k[len(prefix) :]: v for k, v in layer_weights.items() if k.startswith(prefix)}
        if not params:
            continue
        weight = params.get("weight")
        if weight is None or weight.shape[0] != num_experts:
            continue
        clone = copy.copy(router)
        clone.update(tree_unflatten(list(params.items())))
        mx.eval(clone.parameters())
        return clone
    return None


def parse_capacity(spec: str | int | None) -> Capacity:
    if spec is None:
        raise CacheCapacityError("no expert cache size given")
    return Capacity.parse(spec)


def install_expert_offload(
    model: nn.Module,
    root: str | Path,
    manifest: dict,
    *,
    capacity: str | int,
    policy: str = "lru",
    threads: int = 8,
    prefetch: str = "none",
    record_routing: str | None = None,
    model_config: dict | None = None,
    verify: bool = True,
    window_tokens: int = 256,
    stacked: bool = False,
    drop_page_cache: bool = False,
    io_timeout: float = 30.0,
) -> ExpertOffload:
    """Replace every SwitchGLU of a prepared model with an OffloadedSwitchGLU.

    `model` is the mlx-lm model built from the prepared directory `root`
    (experts may or may not be loaded: their tensors are dropped either way).
    Raises CacheCapacityError (a ValueError) for a capacity smaller than one
    layer's top-k or an unknown policy / prefetch mode.
    """
    if prefetch not in ("auto", "none", "next-layer"):
        raise CacheCapacityError(f"expert prefetch {prefetch!r}: choose auto, none or next-layer")
    root = Path(root)
    cap = parse_capacity(capacity)
    make_policy(policy)  # an unknown name fails before any work
    layouts = layouts_from_manifest(root, manifest)
    if not layouts:
        raise CacheCapacityError("--expert-cache needs an MoE model; this one has no experts")
    model_config = model_config or {}
    infos: dict[int, OffloadLayer] = {}
    blocks: dict[int, tuple[nn.Module, str]] = {}
    for layer, layout in sorted(layouts.items()):
        template = _get(model, layout.path)
        block_path = layout.path.rsplit(".", 1)[0]
        block = _get(model, block_path)
        info = OffloadLayer(
            layer=layer, layout=layout, template=template, top_k=_top_k(block, model_config)
        )
        for spec in layout.tensors:
            owner_path, _, key = spec.name.rpartition(".")
            owner = _get(template, owner_path) if owner_path else template
            info.slots.append((owner, key, spec.name))
        infos[layer] = info
        blocks[layer] = (block, block_path)

    for layer, info in infos.items():
        need_slots = info.top_k
        need_bytes = info.top_k * info.layout.record_bytes
        if not cap.fits(need_slots, need_bytes):
            raise CacheCapacityError(
                f"expert cache of {cap.describe()} is smaller than one layer's top-k: layer "
                f"{layer} routes each token to {info.top_k} experts of "
                f"{fmt_bytes(info.layout.record_bytes)} each; use --expert-cache "
                f"{need_slots} (slots) or {fmt_bytes(need_bytes)} or more"
            )

    order = sorted(infos)
    for a, b in itertools.pairwise(order):
        infos[a].next_layer = b
    if prefetch == "next-layer":
        by_index = {entry["index"]: entry for entry in manifest["layers"]}
        for layer in order[1:]:
            block, block_path = blocks[layer]
            entry = by_index[layer]
            weights = derived.fill(mx.load(str(root / entry["file"])), entry.get("derived"))
            infos[layer].router = _router_copy(
                block, block_path, infos[layer].layout.num_experts, weights
            )
            del weights
            if infos[layer].router is None:
                log.warning("layer %d: no router found; its experts are not prefetched", layer)

    store = ExpertStore(
        layouts,
        threads=threads,
        verify=verify,
        drop_page_cache=drop_page_cache,
        io_timeout=io_timeout,
    )
    # Spare record buffers beyond the prefill's reads in flight only hold memory.
    store.max_free = max(2 * threads, 4)
    # LFU's half-life is counted in decoded tokens: one token uses top-k experts per layer.
    cache_policy = make_policy(policy, accesses_per_token=sum(i.top_k for i in infos.values()))

    def recycle(key: Key, value: CachedExpert) -> None:
        # The layer's lists over every cached expert (compute.built_ahead) are stale
        # now, and would keep the evicted buffer alive: the spare pool holds only
        # a few, so with next-layer prefetch's evictions, 280 MB of evicted
        # experts stayed in memory beside a 300 MB cache.
        infos[key[0]].every = None
        if value.buffer is not None:  # slab views have no record buffer of their own
            store.recycle(value.buffer)

    cache = ExpertCache(cap, cache_policy, on_evict=recycle)
    trace = RoutingTrace(record_routing) if record_routing else None
    offload = ExpertOffload(
        store,
        cache,
        infos,
        prefetch=prefetch == "next-layer",
        trace=trace,
        window_tokens=window_tokens,
    )
    offload.stacked = stacked
    for layer, info in infos.items():
        # Drop the stacked expert tensors: from now on they come from the cache.
        for module, key, _ in info.slots:
            module[key] = EMPTY
        block, _ = blocks[layer]
        attr = info.layout.path.rsplit(".", 1)[1]
        block[attr] = OffloadedSwitchGLU(offload, layer)
    total = sum(i.layout.num_experts for i in infos.values())
    log.info(
        "expert offload: %d MoE layers, %d experts of %s on disk, cache %s (%s), "
        "%d I/O threads, prefetch %s",
        len(infos),
        total,
        fmt_bytes(max(offload.nbytes.values())),
        cap.describe(),
        cache_policy.name,
        threads,
        prefetch,
    )
    return offload


def offload_from_config(
    model: nn.Module,
    root: str | Path,
    manifest: dict,
    config: EngineConfig,
    model_config: dict,
) -> ExpertOffload:
    """install_expert_offload with the knobs of an EngineConfig; ModelLoadError on bad input."""
    try:
        return install_expert_offload(
            model,
            root,
            manifest,
            capacity=config.expert_cache,
            policy=config.expert_policy,
            threads=int(config.expert_threads),
            prefetch=config.expert_prefetch,
            record_routing=config.record_routing,
            model_config=model_config,
            verify=bool(config.extra.get("expert_verify", True)),
            window_tokens=int(config.extra.get("expert_stats_window", 256)),
            stacked=config.extra.get("expert_compute", "per-expert") == "stacked",
            drop_page_cache=bool(config.extra.get("stream_drop_page_cache", False)),
            io_timeout=float(config.io_timeout),
        )
    except (CacheCapacityError, ValueError, OSError) as exc:
        raise ModelLoadError(f"expert cache: {exc}") from exc
