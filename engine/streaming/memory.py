"""Memory probes (process, system, MLX) and the report behind GET /memory.

Every probe here is cheap (a /proc read or an MLX counter) so a dashboard can
poll the report every second. Linux reads /proc; macOS falls back to `ps`,
sysconf and `vm_stat`.

On Linux the memory this process may use is also bounded by its cgroup (a
container's limit, a systemd unit's MemoryMax): past it the kernel reclaims
and then kills, whatever /proc/meminfo says. So available memory is the
smaller of the host's MemAvailable and the tightest cgroup on the way from
this process's group to the root: limit - usage + the group's file LRU pages
(page cache the kernel drops before it kills anything; MemAvailable counts
page cache the same way). v1 (`memory.limit_in_bytes`, `memory.usage_in_bytes`,
`memory.stat` total_inactive_file + total_active_file) and v2 (`memory.max`
and `memory.high`, `memory.current`, `memory.stat` inactive_file +
active_file) are both read; "no limit" (v2 `max`, v1 a page-aligned LONG_MAX)
is skipped. Residency planning, shedding and /memory all see this number.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

log = logging.getLogger(__name__)

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
# v1 writes "no limit" as LONG_MAX rounded down to a page; anything this large is none.
_UNLIMITED = 1 << 62


@dataclass
class SystemMemory:
    total: int  # the smaller of the host's memory and the cgroup limit
    available: int
    limit_source: str = "host"  # "host", or "cgroup v1 <dir>" / "cgroup v2 <dir>"


@dataclass(frozen=True)
class CgroupMemory:
    limit: int  # the smallest limit from this process's group up to the root
    available: int  # the least room left in any of those groups
    source: str  # "cgroup v1 <dir>" / "cgroup v2 <dir>": the group of that limit


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


def process_private() -> int:
    """This process's private resident memory (RssAnon: heap, MLX buffers, weights
    read into memory; not the page cache of the files it reads). 0 off Linux."""
    return _status_bytes(b"RssAnon:")


def process_file_resident() -> int:
    """This process's file-backed resident memory (RssFile: the code and files it has
    mapped and touched; 0 off Linux): what the memory plan keeps room for."""
    return _status_bytes(b"RssFile:")


def _status_bytes(key: bytes) -> int:
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def system_memory(cgroup_root: Path | None = None, self_cgroup: Path = SELF_CGROUP) -> SystemMemory:
    """Total and available memory in bytes for this process: the host's
    (available: what can be allocated without swapping, MemAvailable on
    Linux), bounded by its cgroup's limit (see the module doc)."""
    host = _host_memory()
    group = cgroup_memory(cgroup_root, self_cgroup)
    if group is None:
        return host
    available = min(host.available, group.available)
    if group.limit >= host.total:
        return SystemMemory(host.total, available, "host")
    return SystemMemory(group.limit, available, group.source)


def cgroup_memory(root: Path | None = None, self_cgroup: Path = SELF_CGROUP) -> CgroupMemory | None:
    """The memory limit of this process's cgroup (v1 or v2); None when unlimited or
    not on Linux. `root`: where the hierarchies are mounted (default
    /sys/fs/cgroup; tests pass a fake tree, and the file listing this process's
    groups as `self_cgroup`)."""
    root = Path(root or CGROUP_ROOT)
    try:
        lines = Path(self_cgroup).read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            v1 = parts[2]
        elif parts[0] == "0" and not parts[1]:
            v2 = parts[2]
    if v1 is not None:
        mounts = [d for d in _dirs(root) if "memory" in d.name.split(",")]
        for mount in mounts:
            if (mount / "memory.limit_in_bytes").exists():
                return _tightest(mount, v1, _v1_group, "cgroup v1")
    if v2 is not None:
        for mount in (root, root / "unified"):
            if (mount / "cgroup.controllers").exists():
                found = _tightest(mount, v2, _v2_group, "cgroup v2")
                if found is not None:
                    return found
    return None


def _dirs(root: Path) -> list[Path]:
    try:
        return sorted(d for d in root.iterdir() if d.is_dir())
    except OSError:
        return []


def _tightest(
    mount: Path, path: str, probe: Callable[[Path], tuple[int, int] | None], kind: str
) -> CgroupMemory | None:
    """Walk from the process's group up to the mount; the smallest limit and room."""
    group = mount / path.strip("/")
    if not group.is_dir():
        # In a container without a cgroup namespace /proc/self/cgroup names the
        # host's path, while the container's own group is mounted at the root.
        group = mount
    found: CgroupMemory | None = None
    while True:
        try:
            limits = probe(group)
        except (OSError, ValueError):
            limits = None
        if limits is not None:
            limit, available = limits
            if found is None or limit < found.limit:
                found = CgroupMemory(limit, available, f"{kind} {group}")
            if available < found.available:
                found = CgroupMemory(found.limit, available, found.source)
        if group == mount or mount not in group.parents:
            return found
        group = group.parent


def _stat(group: Path) -> dict[str, int]:
    out = {}
    for line in (group / "memory.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _room(limit: int, usage: int, reclaimable: int) -> tuple[int, int]:
    return limit, max(0, min(limit, limit - usage + reclaimable))


def _v1_group(group: Path) -> tuple[int, int] | None:
    limit = int((group / "memory.limit_in_bytes").read_text())
    if limit >= _UNLIMITED:
        return None
    usage = int((group / "memory.usage_in_bytes").read_text())
    stat = _stat(group)
    reclaimable = stat.get("total_inactive_file", stat.get("inactive_file", 0)) + stat.get(
        "total_active_file", stat.get("active_file", 0)
    )
    return _room(limit, usage, reclaimable)


def _v2_group(group: Path) -> tuple[int, int] | None:
    limits = []
    for name in ("memory.max", "memory.high"):  # high: past it the kernel throttles
        file = group / name
        if file.exists() and (value := file.read_text().strip()) != "max":
            limits.append(int(value))
    if not limits or min(limits) >= _UNLIMITED:
        return None
    usage = int((group / "memory.current").read_text())
    stat = _stat(group)
    return _room(min(limits), usage, stat.get("inactive_file", 0) + stat.get("active_file", 0))


def _host_memory() -> SystemMemory:
    """The machine's total and available memory."""
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
    system_total_bytes: int  # the smaller of the host's memory and the cgroup limit
    system_available_bytes: int
    memory_limit_bytes: int  # what this process may use: host memory or its cgroup's limit
    memory_limit_source: str  # "host", or "cgroup v1 <dir>" / "cgroup v2 <dir>"
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
    # Bytes read from disk per decoder layer since start (streamed layer files;
    # offloaded experts are counted per layer in the expert cache's stats).
    layer_bytes_read: list[int] = field(default_factory=list)
    # Resident on loan: the dense plan's unused KV and prefill room (streaming/lending.py)
    lent_layers: list[int] = field(default_factory=list)
    shedding_events: list[dict] = field(default_factory=list)
    plan: dict | None = None  # ResidencyPlan as a dict (N, layers, inputs); None: not streamed
    streaming: dict | None = None  # StreamStats as a dict; None: not streamed
    private_bytes: int = 0  # RssAnon: what the kernel cannot drop (Linux)
    expert_cache_bytes: int = 0  # experts held by the expert cache
    # private - resident weights - expert cache - KV: the runtime's own memory
    # (MLX's pool, buffers, the prompt cache's memory tier, Python)
    overhead_bytes: int = 0
    memory_plan: dict | None = None  # the memory plan (memplan.py, denseplan.py)
    context_length: int = 0  # tokens a request may use: the model's, or the memory-bound
    model_context_length: int | None = None  # the model's own, where memory bounds it

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
    kv = kv_cache_bytes if kv_cache_bytes is not None else kv_cache_nbytes(prompt_caches)
    experts = getattr(loaded, "experts", None)
    expert_bytes = int(experts.cache.nbytes) if experts is not None else 0
    private = process_private()
    plan = getattr(streamer, "memory_plan", None)
    return MemoryReport(
        private_bytes=private,
        expert_cache_bytes=expert_bytes,
        overhead_bytes=max(0, private - layout["resident_weight_bytes"] - expert_bytes - kv),
        memory_plan=plan.to_dict() if plan is not None else None,
        context_length=int(getattr(loaded, "context_length", 0) or 0),
        model_context_length=getattr(loaded, "model_context_length", None),
        rss_bytes=process_rss(),
        system_total_bytes=sysmem.total,
        system_available_bytes=sysmem.available,
        memory_limit_bytes=sysmem.total,
        memory_limit_source=sysmem.limit_source,
        mlx_active_bytes=mlxmem.active,
        mlx_peak_bytes=mlxmem.peak,
        mlx_cache_bytes=mlxmem.cache,
        prompt_cache_bytes=prompt_cache_bytes,
        kv_cache_bytes=kv,
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
        "layer_bytes_read": [0] * len(layers),
    }
