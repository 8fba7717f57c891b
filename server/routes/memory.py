"""GET /memory: process, system and MLX memory, and where the layers are.

Cheap enough to poll every second: it reads counters and array sizes, never
runs MLX work, and never waits on the worker.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from flashserve.engine.generation.worker import Engine
from flashserve.engine.streaming.memory import memory_report
from flashserve.server.http.deps import EngineDep, PoolDep, ReadyModel
from flashserve.server.http.errors import error_responses

router = APIRouter(tags=["memory"])


class BatchView(BaseModel):
    size: int = Field(description="sequences in the last decode step")
    active: int = Field(description="requests in the batch now")
    queued: int = Field(description="requests waiting for a batch slot")
    steps: int = Field(description="decode steps since start")
    last_step_read_bytes: int = Field(
        description="weight bytes read from disk (layers + experts) by the last decode step; "
        "one read serves the whole batch"
    )
    last_step_read_bytes_per_sequence: float


class MemoryResponse(BaseModel):
    rss_bytes: int = Field(description="resident set size of the server process")
    system_total_bytes: int = Field(description="host memory, or the cgroup limit when smaller")
    system_available_bytes: int = Field(
        description="what can be allocated without swapping or passing the cgroup limit"
    )
    memory_limit_bytes: int = Field(description="the memory this process may use")
    memory_limit_source: str = Field(
        description='where that limit comes from: "host", "cgroup v1 <dir>" or "cgroup v2 <dir>"'
    )
    mlx_active_bytes: int
    mlx_peak_bytes: int
    mlx_cache_bytes: int
    num_layers: int
    resident_layers: list[int]
    streamed_layers: list[int]
    resident_weight_bytes: int = Field(description="non-layer + resident layer weights")
    non_layer_bytes: int
    streaming_buffer_bytes: int = Field(description="streamed-layer weights in flight")
    kv_cache_bytes: int = Field(description="KV cache and recurrent state of active requests")
    prompt_cache_bytes: int = Field(description="cached prompt states kept for prefix reuse")
    layer_bytes_read: list[int] = Field(
        description="bytes read from disk per decoder layer since start: streamed layer files "
        "(offloaded experts: per layer in /cache/stats)"
    )
    shedding_events: list[dict] = Field(description="resident layers shed under pressure")
    lent_layers: list[int] = Field(
        description="layers resident on loan (also in resident_layers): the memory plan's "
        "KV and prefill room while unused; streamed again before it is needed"
    )
    plan: dict | None = Field(description="the residency plan and its inputs; null: all resident")
    private_bytes: int = Field(description="private resident memory (RssAnon; 0 off Linux)")
    expert_cache_bytes: int = Field(description="experts held by the expert cache")
    overhead_bytes: int = Field(
        description="private memory besides resident weights, the expert cache and KV"
    )
    memory_plan: dict | None = Field(
        description="--expert-cache auto, or --residency auto on a dense model: the split of "
        "the memory limit and why; null: not asked"
    )
    context_length: int = Field(
        description="tokens a request may use (prompt + answer): the model's context, or "
        "less where the memory plan bounds it (the KV that fits)"
    )
    model_context_length: int | None = Field(
        description="the model's own context where memory bounds context_length; null: it does not"
    )
    streaming: dict | None = Field(description="streamed-layer counters; null: all resident")
    batch: BatchView
    distributed: dict | None = Field(
        None,
        description="the model split across ranks: each rank's layers (first, last) and "
        "memory (rank 0's now, the others' from their last heartbeat); null: one process",
    )
    vision: dict | None = Field(
        None,
        description="a vision-language model's tower and projector: weight_bytes (always "
        "resident), images_encoded, encode_seconds; null: a text-only model",
    )
    models: list[dict[str, Any]] | None = Field(
        None,
        description="several models: each one's state and the private memory its load "
        "added; the rest of this report is the model `?model=` names (default: the "
        "--model, else the most recently used)",
    )


@router.get("/memory", response_model=MemoryResponse, responses=error_responses(503))
def get_memory(loaded: ReadyModel, engine: EngineDep, pool: PoolDep) -> MemoryResponse:
    stats = engine.stats
    report = memory_report(
        loaded, kv_cache_bytes=stats.kv_cache_bytes, prompt_cache_bytes=_prompt_cache_bytes(engine)
    )
    batch = BatchView(
        size=stats.batch_size,
        active=stats.active,
        queued=engine.stats_dict()["queued"],
        steps=stats.steps,
        last_step_read_bytes=stats.last_step_read_bytes,
        last_step_read_bytes_per_sequence=stats.last_step_read_bytes / max(stats.batch_size, 1),
    )
    mirror = getattr(engine, "mirror", None)
    distributed = mirror.report() if mirror is not None else None
    models = pool.describe() if len(pool.slots) > 1 else None
    vision = loaded.vision.report() if loaded.vision is not None else None
    return MemoryResponse(
        **report.to_dict(), batch=batch, distributed=distributed, vision=vision, models=models
    )


def metric_numbers(engine: Engine) -> dict[str, Any]:
    """The /memory report for /metrics (server/http/metrics.py): RSS, system and MLX
    memory, resident vs streamed layers, streaming stats (nested dicts become
    name_key gauges, lists their lengths)."""
    loaded = getattr(engine, "loaded", None)
    if loaded is None:
        return {}
    report = memory_report(
        loaded,
        kv_cache_bytes=engine.stats.kv_cache_bytes,
        prompt_cache_bytes=_prompt_cache_bytes(engine),
    ).to_dict()
    report.pop("layer_bytes_read")  # one number per layer; its sum is streaming_bytes_read
    return report


def distributed_numbers(engine: Engine) -> dict[str, Any]:
    """For /metrics: the split model's transfer time per step and messages; none
    when the model runs in one process."""
    mirror = getattr(engine, "mirror", None)
    return mirror.numbers() if mirror is not None else {}


def _prompt_cache_bytes(engine: Engine) -> int:
    cache = getattr(engine, "prompt_cache", None)
    return 0 if cache is None else cache.nbytes
