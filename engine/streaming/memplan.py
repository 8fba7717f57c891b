"""The memory plan behind `--expert-cache auto`: the memory this process may use,
divided between resident layers, the expert cache, KV and the prompt cache.

An MoE model larger than memory runs well only when most of what it may use
holds experts: every routed expert the cache misses is a read from disk. So
the plan starts from the real limit (the cgroup's where there is one, else
the host's available memory; streaming/memory.py) and takes out, in order:

* what is in use already (`limit - available` at load: the interpreter, the
  server, MLX, the non-layer weights just loaded);
* the shed floor and half as much again as headroom, so the steady state
  never trips shedding (the floor itself shrinks with the limit: 4% of it, at
  least 32 MB, never more than the configured floor);
* the runtime reserve: MLX's buffer pool (its cache limit is set to the
  number planned here; MLX's default is the whole host's memory), the
  expert reads in flight and the store's spare record buffers, and a measured
  margin for the Python heap (RUNTIME_BASE); under a limit below 4 GB the
  prefill takes 256-token chunks and 4 expert I/O threads, to hold less;
* KV for `residency_mode`'s tokens (balanced: 1024), and the prompt cache's
  memory tier: half such a context with the disk tier on (the disk keeps the
  rest), one without;
* dense layers (attention, norms, router: the layers without their experts)
  resident before any expert is cached: a resident dense byte saves one byte
  read per token, an expert-cache byte at most top_k / num_experts of one
  (uniform routing), so dense layers go first;
* what is left is the expert cache (never more than all experts, never less
  than one layer's top-k twice).

What a prefill holds only while it runs is not taken out for good: a
chunk's activations and the hidden states a layer-major prefill holds, and at
a prompt-cache hit the copies of the state it starts from. The expert cache
lends that room instead: a prefill first evicts experts until its share is
free and keeps the cache that much smaller until it ends
(experts/prefill.py `hold_room`); decode misses then fill the cache back up.
A prefill reads nearly every expert of a layer anyway, so the experts it
evicts cost little, and between prompts the room holds experts: more of them
under the same peak (docs/benchmarks/memory-cap.md).

The plan, its inputs and the reason for each number are logged at load and
served in GET /memory (`memory_plan`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import mlx.core as mx

from flashserve.engine.compute import heap
from flashserve.engine.config import EngineConfig
from flashserve.engine.streaming.memory import system_memory
from flashserve.engine.streaming.residency import MODES, fmt_bytes

log = logging.getLogger(__name__)

MB = 1024 * 1024
FLOOR_FRACTION = 0.04  # of the limit: the shed floor under a small limit
MIN_FLOOR = 32 * MB
# The private memory serving adds besides weights, KV, experts, MLX's pool and
# arrays, and the activations counted below (Python objects, tokenizer and HTTP
# state). Measured (docs/benchmarks/memory-cap.md): 40 MB after a turn of the
# 3 GB MoE under a 1.2 GB cap (private - MLX's active arrays and pool - what
# was in use at load); a quarter again as margin.
RUNTIME_BASE = 48 * MB
# MLX's buffer pool: 1.5% of the limit, at most 64 MB; freed buffers past it go
# back to the OS. A decode step's buffers are small; a prefill's large ones
# cost a page fault per 4 KB when allocated afresh, next to a read of MBs.
MLX_CACHE_FRACTION = 0.015
MLX_CACHE_MAX = 64 * MB
# Of the room left, for allocator slack: expert records are whole buffers of
# their own (mapped, page-rounded), and the measured slack was nil.
EXPERT_SAFETY = 0.98
GROUP_FRACTION = 0.04  # of the limit: hidden states a layer-major prefill may hold
# Under a limit this small the plan also trims what a prefill holds at once:
# 256-token chunks (a 512-token chunk's attention scores alone are heads x 1 MB)
# and 4 expert I/O threads (8 records in flight; 2 MB records at a few hundred
# MB/s keep a disk busy with fewer).
SMALL_LIMIT = 4 << 30
SMALL_STEP = 256
SMALL_THREADS = 4


@dataclass
class ModelShape:
    """What the plan needs to know of a model (prepared manifest + config)."""

    layer_bytes: list[int]  # per decoder layer, without its experts
    expert_bytes: int  # all experts of all layers
    record_bytes: int  # the largest expert record
    top_k: int  # experts per token per layer
    num_experts: int  # per layer
    kv_bytes_per_token: int
    activation_bytes: int  # a prefill chunk's activations and logits (runtime_reserve)
    prefetch_depth: int = 2
    io_window: int = 16  # expert records in flight during a prefill


@dataclass
class MemoryPlan:
    limit_bytes: int
    limit_source: str  # "host" or "cgroup v1/v2 <dir>"
    available_bytes: int  # room left at plan time
    in_use_bytes: int  # limit - available: what was in use already
    shed_floor_bytes: int
    headroom_bytes: int
    mlx_cache_limit_bytes: int
    runtime_reserve_bytes: int
    prefill_reserve_bytes: int  # lent by the expert cache while a prefill runs
    kv_reserve_bytes: int
    kv_reserve_tokens: int
    prompt_cache_bytes: int
    num_layers: int
    resident_layers: int
    resident_layer_bytes: int
    stream_buffer_bytes: int
    expert_cache_bytes: int
    expert_total_bytes: int
    reasons: list[str] = field(default_factory=list)
    # The dense plan's (streaming/denseplan.py); None or 0 in the expert cache's
    file_reserve_bytes: int = 0  # kept free: the shed floor + headroom, or the code's pages
    context_tokens: int | None = None  # the memory-bound context
    kv_budget_tokens: int | None = None  # KV tokens of the whole batch (>= the context)
    prefill_step_size: int | None = None
    prefetch_depth: int | None = None
    kv_bits: int | None = None  # the KV cache's precision (None: float)

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if self.context_tokens is not None:
            return (
                f"memory plan: limit {fmt_bytes(self.limit_bytes)} ({self.limit_source}), "
                f"in use {fmt_bytes(self.in_use_bytes)}, kept free "
                f"{fmt_bytes(self.file_reserve_bytes)}, runtime "
                f"{fmt_bytes(self.runtime_reserve_bytes)} (MLX pool "
                f"{fmt_bytes(self.mlx_cache_limit_bytes)}), prefill "
                f"{fmt_bytes(self.prefill_reserve_bytes)}, KV {fmt_bytes(self.kv_reserve_bytes)} "
                f"({self.context_tokens} tokens, {kv_precision(self.kv_bits)}), prompt cache "
                f"{fmt_bytes(self.prompt_cache_bytes)}, {self.resident_layers}/{self.num_layers} "
                f"layers resident {fmt_bytes(self.resident_layer_bytes)}, stream buffers "
                f"{fmt_bytes(self.stream_buffer_bytes)}"
            )
        share = self.expert_cache_bytes / self.limit_bytes if self.limit_bytes else 0.0
        return (
            f"memory plan: limit {fmt_bytes(self.limit_bytes)} ({self.limit_source}), "
            f"in use {fmt_bytes(self.in_use_bytes)}, shed floor "
            f"{fmt_bytes(self.shed_floor_bytes)} + headroom {fmt_bytes(self.headroom_bytes)}, "
            f"runtime {fmt_bytes(self.runtime_reserve_bytes)} (MLX pool "
            f"{fmt_bytes(self.mlx_cache_limit_bytes)}), prefill "
            f"{fmt_bytes(self.prefill_reserve_bytes)} (lent by the expert cache), "
            f"KV {fmt_bytes(self.kv_reserve_bytes)} "
            f"({self.kv_reserve_tokens} tokens), "
            f"prompt cache {fmt_bytes(self.prompt_cache_bytes)}, "
            f"{self.resident_layers}/{self.num_layers} dense layers resident "
            f"{fmt_bytes(self.resident_layer_bytes)}, stream buffers "
            f"{fmt_bytes(self.stream_buffer_bytes)}, expert cache "
            f"{fmt_bytes(self.expert_cache_bytes)} of {fmt_bytes(self.expert_total_bytes)} "
            f"({share:.0%} of the limit)"
        )


def shed_floor_bytes(limit: int, configured: int) -> int:
    """The shed floor under `limit`: 4% of it, at least MIN_FLOOR, at most `configured`."""
    return min(int(configured), max(MIN_FLOOR, int(limit * FLOOR_FRACTION)))


def mlx_pool_bytes(limit: int) -> int:
    """MLX's buffer pool under `limit` (MLX_CACHE_FRACTION of it, at most MLX_CACHE_MAX)."""
    return min(MLX_CACHE_MAX, int(limit * MLX_CACHE_FRACTION))


def plan_memory(
    shape: ModelShape,
    *,
    limit: int,
    available: int,
    source: str,
    shed_floor: int,
    kv_tokens: int,
    prompt_cache_bytes: int,
    resident_layers: int | None = None,
    disk_tier: bool = False,
) -> MemoryPlan:
    """Divide `available` (of `limit`) as the module doc says.

    `resident_layers`: a layer count fixed by the user (None: dense layers
    first, as many as fit). Never raises: a limit too small for the minimum
    still gets a plan (the minimum expert cache), with a warning in `reasons`.
    """
    reasons = []
    floor = shed_floor_bytes(limit, shed_floor)
    reasons.append(
        f"shed floor {fmt_bytes(floor)}: 4% of the limit (at least 32 MB, at most the "
        f"configured {fmt_bytes(shed_floor)}), and half as much again as headroom"
    )
    mlx_cache = mlx_pool_bytes(limit)
    io_buffers = 2 * shape.io_window * shape.record_bytes  # in flight + the spare pool
    runtime = RUNTIME_BASE + mlx_cache + io_buffers
    reasons.append(
        f"runtime {fmt_bytes(runtime)}: base {fmt_bytes(RUNTIME_BASE)} (measured), MLX pool "
        f"{fmt_bytes(mlx_cache)}, expert reads {fmt_bytes(io_buffers)} "
        f"(2 x {shape.io_window} records)"
    )
    prefill = shape.activation_bytes
    reasons.append(
        f"prefill {fmt_bytes(prefill)} (a chunk's activations and the hidden states held): "
        "lent by the expert cache while a prompt is prefilled, experts the rest of the time"
    )
    kv = kv_tokens * shape.kv_bytes_per_token
    # With a disk tier, half a context in memory: the newest states stay (the next
    # turn of a short conversation); longer ones come back from disk (~KV bytes).
    prompt = min(int(prompt_cache_bytes), kv // 2 if disk_tier else kv)
    reasons.append(
        f"prompt cache memory tier {fmt_bytes(prompt)}: "
        + (
            f"half a context of {kv_tokens} tokens (the disk tier keeps the rest)"
            if disk_tier
            else f"one context of {kv_tokens} tokens (no disk tier)"
        )
    )
    headroom = floor // 2
    room = available - floor - headroom - runtime - kv - prompt
    min_experts = 2 * shape.top_k * shape.record_bytes
    num_layers = len(shape.layer_bytes)
    largest = max(shape.layer_bytes, default=0)
    buffers = (shape.prefetch_depth + 1) * largest
    if resident_layers is None:
        count = num_layers
        while (
            count > 0
            and sum(shape.layer_bytes[:count])
            + (buffers if count < num_layers else 0)
            + min_experts
            + prefill
            > room
        ):
            count -= 1
        reasons.append(
            "dense layers resident first: a resident byte saves a byte read per token, "
            f"an expert-cache byte at most {shape.top_k}/{shape.num_experts} of one"
        )
    else:
        count = max(0, min(int(resident_layers), num_layers))
        reasons.append(f"{count} resident layers as configured")
    dense = sum(shape.layer_bytes[:count])
    stream = buffers if count < num_layers else 0
    experts = int((room - dense - stream) * EXPERT_SAFETY)
    if experts >= shape.expert_bytes + prefill:
        reasons.append("every expert fits beside a prefill: the cache holds them all")
        experts, prefill = shape.expert_bytes, 0
    elif experts >= shape.expert_bytes:
        # A cache of every expert runs on slabs (one buffer per layer), which
        # cannot give back part of a layer: it keeps the prefill's room for good.
        reasons.append("every expert fits only with the prefill's room: it stays free")
        experts, prefill = experts - prefill, 0
    if experts - prefill < min_experts:
        reasons.append(
            f"WARNING: the limit leaves {fmt_bytes(max(experts - prefill, 0))} for experts while "
            f"a prompt is prefilled; using the minimum {fmt_bytes(min_experts)} "
            f"(2 x top-{shape.top_k}) then: expect shedding"
        )
        experts = max(experts, min_experts)
        prefill = max(0, min(prefill, experts - min_experts))
    return MemoryPlan(
        limit_bytes=int(limit),
        limit_source=source,
        available_bytes=int(available),
        in_use_bytes=max(0, int(limit) - int(available)),
        shed_floor_bytes=floor,
        headroom_bytes=headroom,
        mlx_cache_limit_bytes=mlx_cache,
        runtime_reserve_bytes=runtime,
        prefill_reserve_bytes=prefill,
        kv_reserve_bytes=kv,
        kv_reserve_tokens=kv_tokens,
        prompt_cache_bytes=prompt,
        num_layers=num_layers,
        resident_layers=count,
        resident_layer_bytes=dense,
        stream_buffer_bytes=stream,
        expert_cache_bytes=experts,
        expert_total_bytes=shape.expert_bytes,
        reasons=reasons,
    )


def shape_from_manifest(
    manifest: dict,
    layer_bytes: list[int],
    model_config: dict,
    *,
    kv_bytes_per_token: int,
    activation_bytes: int,
    prefetch_depth: int,
    io_window: int,
) -> ModelShape:
    """The plan's view of a prepared model: its experts from the manifest."""
    switches = [
        sw
        for entry in manifest["layers"]
        for sw in (entry.get("experts") or {}).get("switches", [])
    ]
    text = model_config.get("text_config") or {}
    top_k = int(model_config.get("num_experts_per_tok") or text.get("num_experts_per_tok") or 1)
    return ModelShape(
        layer_bytes=list(layer_bytes),
        expert_bytes=sum(int(sw["num_experts"]) * int(sw["record_bytes"]) for sw in switches),
        record_bytes=max((int(sw["record_bytes"]) for sw in switches), default=0),
        top_k=top_k,
        num_experts=max((int(sw["num_experts"]) for sw in switches), default=1),
        kv_bytes_per_token=kv_bytes_per_token,
        activation_bytes=activation_bytes,
        prefetch_depth=prefetch_depth,
        io_window=io_window,
    )


def is_auto(spec: object) -> bool:
    """Whether an `expert_cache` setting asks for the memory plan."""
    return isinstance(spec, str) and spec.strip().lower() == "auto"


def apply_memory_plan(
    config: EngineConfig,
    manifest: dict,
    model_config: dict,
    *,
    layer_bytes: list[int],
    kv_bytes_per_token: int,
    context_length: int,
    activations: Callable[[], int],
) -> MemoryPlan:
    """Plan from this process's real limit and write the plan into `config`.

    The numbers replace "auto" in the config the worker reads too (resident
    layers, expert cache bytes, shed floor, the prompt cache's memory tier, the
    layer-major prefill's activations), and MLX's buffer pool is capped. Logs
    the plan and its reasons.
    """
    memory = system_memory()
    small = memory.total < SMALL_LIMIT
    if small:
        config.prefill_step_size = min(int(config.prefill_step_size), SMALL_STEP)
        config.expert_threads = min(int(config.expert_threads), SMALL_THREADS)
    group = min(int(config.prefill_group_bytes), max(MIN_FLOOR, int(memory.total * GROUP_FRACTION)))
    shape = shape_from_manifest(
        manifest,
        layer_bytes,
        model_config,
        kv_bytes_per_token=kv_bytes_per_token,
        activation_bytes=activations() + group,
        prefetch_depth=max(0, int(config.prefetch_depth)),
        io_window=max(2 * int(config.expert_threads), 4),  # experts/offload.py's prefill window
    )

    plan = plan_memory(
        shape,
        limit=memory.total,
        available=memory.available,
        source=memory.limit_source,
        shed_floor=int(config.shed_floor),
        kv_tokens=MODES.get(config.residency_mode) or context_length,
        prompt_cache_bytes=int(config.prompt_cache_bytes),
        resident_layers=config.resident_layers,
        disk_tier=config.prompt_cache_disk_bytes > 0,
    )
    if small:
        plan.reasons.append(
            f"limit under {fmt_bytes(SMALL_LIMIT)}: prefill chunks of {config.prefill_step_size} "
            f"tokens, {config.expert_threads} expert I/O threads"
        )
    if plan.prefill_reserve_bytes > 0:
        # Lent, the held hidden states may take up to half the expert cache: each
        # group of chunks reads every expert of a layer once, so a prompt cut into
        # several small groups reads the experts several times over
        # (docs/benchmarks/memory-cap.md). Evicted experts cost a read each in decode.
        chunk = activations()
        wider = min(
            int(config.prefill_group_bytes),
            max(group, plan.expert_cache_bytes // 2),
            plan.expert_cache_bytes - 2 * shape.top_k * shape.record_bytes - chunk,
        )
        if wider > group:
            group = wider
            plan.prefill_reserve_bytes = chunk + group
            plan.reasons.append(
                f"a layer-major prefill holds up to {fmt_bytes(group)} of hidden states (half "
                "the expert cache, lent while it runs): each group of chunks reads every "
                f"expert once; the prefill room is {fmt_bytes(plan.prefill_reserve_bytes)}"
            )
    if config.expert_prefetch == "auto":
        # The next router's guess serves most misses before they happen and wastes
        # few reads (docs/benchmarks/memory-cap.md) where the experts do not all
        # fit. Its reads come out of the cache's bytes.
        streams = plan.expert_cache_bytes < plan.expert_total_bytes
        config.expert_prefetch = "next-layer" if streams else "none"
        if streams:
            plan.reasons.append(
                "next-layer expert prefetch on: the experts do not all fit, and its reads "
                "come out of the expert cache's bytes"
            )
    config.expert_cache = f"{plan.expert_cache_bytes}B"
    config.resident_layers = plan.resident_layers
    config.memory_budget = None
    config.shed_floor = plan.shed_floor_bytes
    config.prompt_cache_bytes = plan.prompt_cache_bytes
    config.prefill_group_bytes = group
    return enforce(plan)


def kv_precision(bits: int | None) -> str:
    return "float" if bits is None else f"{bits}-bit"


def enforce(plan: MemoryPlan) -> MemoryPlan:
    """What the process itself holds to the plan: MLX's buffer pool capped, glibc's
    mmap threshold fixed (compute/heap.py); then the plan and its reasons logged."""
    mx.set_cache_limit(plan.mlx_cache_limit_bytes)
    if heap.fix_mmap_threshold():
        plan.reasons.append(
            f"large blocks ({heap.MMAP_THRESHOLD // 1024} KB and up) mapped on their own: "
            "freed activations go back to the system (from the arenas once a prefill ends)"
        )
    log.info(plan.describe())
    for reason in plan.reasons:
        log.info("memory plan: %s", reason)
    return plan
