"""GET /cache/stats: the MoE expert cache, for dashboards that poll every second.

Also served at /v1/cache/stats. The engine copies its counters under a lock
held only for a small numpy copy, so a poll never waits on generation and
never runs MLX. `POST /cache/stats/reset` empties the window (the last-N-tokens
view); counters since start are never reset. `?layers=false` leaves out the
per-layer lists for the cheapest poll.

A model without an expert cache answers 200 with `enabled: false`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from flashserve.engine.generation.worker import Engine
from flashserve.server.http.deps import EngineDep, ReadyModel
from flashserve.server.http.errors import error_responses

router = APIRouter(tags=["cache"])


class LayerCacheStats(BaseModel):
    layer: int = Field(description="decoder layer index")
    hits: int = Field(description="needed experts found in the cache")
    prefetch_hits: int = Field(description="needed experts found among next-layer prefetches")
    misses: int = Field(description="needed experts read from disk on demand")
    hit_rate: float = Field(description="hits / (hits + prefetch_hits + misses)")
    served_without_demand_read: float = Field(description="(hits + prefetch_hits) / accesses")
    evictions: int
    bytes_read: int = Field(description="bytes read from disk: demand + prefetch")
    read_gb_per_s: float = Field(description="demand bytes / wall time of demand reads")
    blocked_s: float = Field(description="seconds the generation waited on expert I/O")
    prefetch_precision: float | None = Field(description="predicted and needed / predicted")
    prefetch_recall: float | None = Field(description="predicted and needed / needed")
    prefetch_reads: int
    prefetch_bytes: int
    prefetch_wasted: int = Field(description="prefetched experts that were not needed")
    prefetch_wasted_bytes: int
    resident_experts: int
    resident_bytes: int


class CacheStatsView(BaseModel):
    tokens: int = Field(description="tokens that went through the MoE layers")
    forwards: int = Field(description="forward passes (a prefill chunk or a decode step)")
    token_seconds: float = Field(description="wall time between forwards, idle gaps excluded")
    hits: int
    prefetch_hits: int
    misses: int
    hit_rate: float
    served_without_demand_read: float
    evictions: int
    bytes_read: int
    bytes_read_per_token: float
    read_gb_per_s: float
    blocked_s: float
    io_wait_share: float = Field(description="blocked_s / token_seconds")
    prefetch_precision: float | None
    prefetch_recall: float | None
    prefetch_reads: int
    prefetch_bytes: int
    prefetch_wasted: int
    prefetch_wasted_bytes: int
    layers: list[LayerCacheStats] | None = None


class CacheStepView(BaseModel):
    tokens: int = Field(description="tokens in the last step: the sequences of a decode step")
    expert_uses: int = Field(description="(token, expert) routings over all MoE layers")
    experts_needed: int = Field(
        description="distinct experts per layer, summed: each is looked up and loaded once "
        "for the whole batch"
    )
    expert_reads: int = Field(description="needed experts read from disk on demand")
    bytes_read: int
    uses_per_needed_expert: float = Field(
        description="expert_uses / experts_needed: how many routings one load served"
    )


class PromptMemoryView(BaseModel):
    """The prompt cache's memory tier."""

    max_bytes: int = Field(description="memory the cached prompt states may use")
    entries: int
    bytes: int
    hits: int = Field(description="prompts served from memory")
    misses: int = Field(description="prompts memory could not serve")
    stored: int = Field(description="prompt states stored")
    released_bytes: int = Field(description="bytes given back under memory pressure")


class PromptDiskView(BaseModel):
    """The prompt cache's SSD tier."""

    dir: str
    max_bytes: int = Field(description="bound of the whole directory, other models included")
    entries: int = Field(description="entries of this model")
    bytes: int = Field(description="bytes of this model's entries")
    dir_bytes: int = Field(description="bytes of every entry in the directory")
    hits: int = Field(
        description="prompts served from an entry read back from disk, or from a state "
        "still queued for writing (its bytes in memory)"
    )
    misses: int = Field(description="prompts neither tier could serve")
    bytes_read: int
    bytes_written: int
    written: int = Field(description="entries written")
    evicted: int = Field(
        description="entries deleted to stay in budget, made redundant, or continuing one "
        "that was deleted"
    )
    discarded: int = Field(description="corrupt or truncated entries deleted, never served")
    write_errors: int = Field(description="writes that failed (e.g. disk full), logged")
    dropped: int = Field(
        description="states not written: the writer was behind, or past the write budget"
    )
    dropped_over_budget: int = Field(description="of those, past write_bytes_per_hour")
    write_bytes_per_hour: int = Field(description="write budget (0: no cap)")
    bytes_written_last_hour: int


class PromptCacheView(BaseModel):
    """The prompt cache (prefix reuse across requests and restarts)."""

    hits: int = Field(description="prompts that started from a cached prefix (either tier)")
    misses: int = Field(description="prompts prefilled from their first token")
    tokens_reused: int = Field(description="prompt tokens restored instead of prefilled")
    tokens_prefilled: int
    memory: PromptMemoryView
    disk: PromptDiskView | None = Field(
        description="null: prompt_cache_disk_bytes is 0 (memory only)"
    )


class CacheStatsResponse(BaseModel):
    enabled: bool = Field(description="false: this model runs without an expert cache")
    policy: str | None = None
    prefetch: str | None = None
    capacity_slots: int | None = None
    capacity_bytes: int | None = None
    occupancy_slots: int | None = None
    occupancy_bytes: int | None = None
    occupancy_fraction: float | None = None
    total_experts: int | None = None
    expert_bytes: int | None = None
    moe_layers: list[int] | None = None
    io_threads: int | None = None
    window_tokens: int | None = Field(None, description="N of the window view")
    uptime_s: float | None = None
    since_start: CacheStatsView | None = None
    window: CacheStatsView | None = None
    batch_size: int | None = Field(None, description="sequences in the last decode step")
    last_step: CacheStepView | None = Field(
        None,
        description="the last finished forward pass (layers whose every expert is cached "
        "are counted two steps late)",
    )
    prompt_cache: PromptCacheView | None = Field(
        None, description="prefix reuse across requests; null: prompt_cache_bytes is 0"
    )


def stats_response(engine: Engine, layers: bool = True) -> CacheStatsResponse:
    prompt_cache = _prompt_cache_view(engine)
    offload = getattr(engine.loaded, "experts", None)
    if offload is None:
        return CacheStatsResponse(enabled=False, prompt_cache=prompt_cache)
    data = asdict(offload.snapshot())
    if not layers:
        data["since_start"]["layers"] = None
        data["window"]["layers"] = None
    return CacheStatsResponse(
        enabled=True, batch_size=engine.stats.batch_size, prompt_cache=prompt_cache, **data
    )


def _prompt_cache_view(engine: Engine) -> PromptCacheView | None:
    cache = getattr(engine, "prompt_cache", None)
    return None if cache is None else PromptCacheView(**cache.snapshot())


@router.get(
    "/cache/stats",
    response_model=CacheStatsResponse,
    response_model_exclude_none=False,
    responses=error_responses(400, 503),
)
@router.get("/v1/cache/stats", response_model=CacheStatsResponse, include_in_schema=False)
async def cache_stats(
    _: ReadyModel,
    engine: EngineDep,
    layers: Annotated[bool, Query(description="include per-layer counters")] = True,
) -> CacheStatsResponse:
    return stats_response(engine, layers)


@router.post(
    "/cache/stats/reset", response_model=CacheStatsResponse, responses=error_responses(503)
)
@router.post("/v1/cache/stats/reset", response_model=CacheStatsResponse, include_in_schema=False)
async def reset_window(loaded: ReadyModel, engine: EngineDep) -> CacheStatsResponse:
    offload = getattr(loaded, "experts", None)
    if offload is not None:
        offload.reset_window()
    return stats_response(engine, layers=False)


# since-start fields of the expert cache that only ever grow
_CACHE_CUMULATIVE = {
    "tokens",
    "forwards",
    "token_seconds",
    "hits",
    "prefetch_hits",
    "misses",
    "evictions",
    "bytes_read",
    "blocked_s",
    "prefetch_reads",
    "prefetch_bytes",
    "prefetch_wasted",
    "prefetch_wasted_bytes",
}


def metric_numbers(engine: Engine) -> dict[str, Any]:
    """/cache/stats for /metrics (server/http/metrics.py), as the JSON endpoint serves it,
    without per-layer lists: counters since start, gauges for the
    occupancy and for the last-N-tokens window."""
    if getattr(engine, "loaded", None) is None:
        return {}
    data = stats_response(engine, layers=False).model_dump()
    since = data.pop("since_start", None) or {}
    for key, value in since.items():
        data[f"{key}_total" if key in _CACHE_CUMULATIVE else f"lifetime_{key}"] = value
    data.pop("moe_layers", None)  # a list of layer indices: its count is in the config
    data.pop("prompt_cache", None)  # its own source: prompt_cache_metric_numbers
    data.pop("batch_size", None)  # the engine's own flashserve_batch_size
    return data


_PROMPT_CACHE_GAUGES = {
    "max_bytes",
    "entries",
    "bytes",
    "dir_bytes",
    "write_bytes_per_hour",
    "bytes_written_last_hour",
}


def prompt_cache_metric_numbers(engine: Engine) -> dict[str, Any]:
    """The prompt_cache block of /cache/stats for /metrics: counters get `_total`,
    a tier's numbers its name (`memory_hits_total`, `disk_bytes_read_total`)."""
    view = _prompt_cache_view(engine) if getattr(engine, "loaded", None) is not None else None
    if view is None:
        return {}
    data = view.model_dump()
    memory, disk = data.pop("memory"), data.pop("disk") or {}
    out: dict[str, Any] = {}
    for prefix, block in (("", data), ("memory_", memory), ("disk_", disk)):
        for key, value in block.items():
            if key != "dir":  # a path, not a number
                out[prefix + key + ("" if key in _PROMPT_CACHE_GAUGES else "_total")] = value
    return out
