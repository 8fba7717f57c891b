"""Memory probes (process, system, MLX) and the report behind GET /memory.

Every probe here is cheap (a /proc read or an MLX counter) so a dashboard can
poll the report every second. Linux reads /proc; macOS falls back to `ps`,
sysconf and `vm_stat`.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

log = logging.getLogger(__name__)

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass
class SystemMemory:
    total: int
    available: int


@dataclass
class MlxMemory:
    active: int
    peak: int
    cache: int


def process_rss() -> int:
    """Resident set size of this process in bytes."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except OSError:
        pass
    try:  # macOS: ru_maxrss is the peak, not the current size, so ask ps
        out = subprocess.run(
            ["ps", "-o", "rss=", "-p", str(os.getpid())],
            capture_output=True,
            text=True,
            timeout=2,
            check=False,
        )
        return int(out.stdout.strip()) * 1024
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def system_memory() -> SystemMemory:
    """Total and available system memory in bytes (available: what can be
    allocated without swapping, i.e. MemAvailable on Linux)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            info = {}
            for line in f:
                key, _, rest = line.partition(b":")
                info[key] = int(rest.split()[0]) * 1024
        return SystemMemory(total=info[b"MemTotal"], available=info[b"MemAvailable"])
    except (OSError, KeyError, ValueError, IndexError):
        pass
    total = _PAGE_SIZE * os.sysconf("SC_PHYS_PAGES")
    return SystemMemory(total=total, available=_macos_available(total))


def _macos_available(total: int) -> int:
    if sys.platform != "darwin":
        return total
    try:
        out = subprocess.run(
            ["vm_stat"], capture_output=True, text=True, timeout=2, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return total
    page = _PAGE_SIZE
    if m := re.search(r"page size of (\d+) bytes", out):
        page = int(m.group(1))
    pages = 0
    for name in ("Pages free", "Pages inactive", "Pages speculative", "Pages purgeable"):
        if m := re.search(rf"{name}:\s+(\d+)", out):
            pages += int(m.group(1))
    return pages * page


def available_memory() -> int:
    return system_memory().available


def mlx_memory() -> MlxMemory:
    return MlxMemory(
        active=mx.get_active_memory(), peak=mx.get_peak_memory(), cache=mx.get_cache_memory()
    )


def kv_cache_nbytes(prompt_caches: Sequence[Any] | None) -> int:
    """Bytes held by mlx-lm cache objects (KV and recurrent state).

    Accepts one prompt cache (a list of per-layer caches) or a list of them
    (one per active request). Caches without `nbytes` are measured from
    their `state` arrays.
    """
    if not prompt_caches:
        return 0
    total = 0
    for item in prompt_caches:
        if isinstance(item, (list, tuple)):
            total += kv_cache_nbytes(item)
            continue
        try:
            total += int(item.nbytes)
        except (AttributeError, NotImplementedError, TypeError):
            try:
                state = item.state
            except Exception:  # a cache that was never filled
                continue
            total += sum(a.nbytes for _, a in tree_flatten(state) if isinstance(a, mx.array))
    return total


@dataclass
class MemoryReport:
    """What GET /memory returns; every field is plain JSON data (asdict)."""

    rss_bytes: int
    system_total_bytes: int
    system_available_bytes: int
    mlx_active_bytes: int
    mlx_peak_bytes: int
    mlx_cache_bytes: int
    num_layers: int
    resident_layers: list[int]
    streamed_layers: list[int]
    resident_weight_bytes: int  # all resident model weights: non-layer + resident layers
    non_layer_bytes: int
    streaming_buffer_bytes: int  # streamed-layer weights in flight (loading or computing)
    kv_cache_bytes: int
    prompt_cache_bytes: int  # cached prompt states kept for reuse (the prompt cache)
    shedding_events: list[dict] = field(default_factory=list)
    plan: dict | None = None  # ResidencyPlan as a dict (N, layers, inputs); None: not streamed
    streaming: dict | None = None  # StreamStats as a dict; None: not streamed

    def to_dict(self) -> dict:
        return asdict(self)


def memory_report(
    loaded: Any,
    *,
    prompt_caches: Sequence[Any] | None = None,
    kv_cache_bytes: int | None = None,
    prompt_cache_bytes: int = 0,
) -> MemoryReport:
    """Snapshot of memory use for `loaded` (an engine.weights.model.LoadedModel).

    KV cache: pass the live prompt caches (`prompt_caches`, one list or a list
    of lists) or a byte count the worker keeps (`kv_cache_bytes`); the count
    wins when both are given. Must not run MLX computations, so it is safe to
    call from any thread (it only reads counters and array sizes).
    """
    streamer = getattr(loaded, "streamer", None)
    layout = _streamed_layout(streamer) if streamer is not None else _resident_layout(loaded)
    sysmem = system_memory()
    mlxmem = mlx_memory()
    return MemoryReport(
        rss_bytes=process_rss(),
        system_total_bytes=sysmem.total,
        system_available_bytes=sysmem.available,
        mlx_active_bytes=mlxmem.active,
        mlx_peak_bytes=mlxmem.peak,
        mlx_cache_bytes=mlxmem.cache,
        prompt_cache_bytes=prompt_cache_bytes,
        kv_cache_bytes=(
            kv_cache_bytes if kv_cache_bytes is not None else kv_cache_nbytes(prompt_caches)
        ),
        **layout,
    )


def _streamed_layout(streamer: Any) -> dict:
    snap = streamer.snapshot()
    streaming = snap.pop("stats")
    return {**snap, "streaming": streaming}


def _resident_layout(loaded: Any) -> dict:
    """A plain (fully resident) model: every layer is resident."""
    model = loaded.model
    layers = list(getattr(model, "layers", []) or [])
    total = sum(a.nbytes for _, a in tree_flatten(model.parameters()) if isinstance(a, mx.array))
    layer_bytes = sum(
        a.nbytes
        for layer in layers
        for _, a in tree_flatten(layer.parameters())
        if isinstance(a, mx.array)
    )
    return {
        "num_layers": len(layers),
        "resident_layers": list(range(len(layers))),
        "streamed_layers": [],
        "resident_weight_bytes": total,
        "non_layer_bytes": total - layer_bytes,
        "streaming_buffer_bytes": 0,
    }
