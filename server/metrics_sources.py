"""The numbers behind /cache/stats and /memory, shaped for /metrics.

Each function reads the same snapshot its JSON endpoint serves, so a dashboard
and a Prometheus scrape never disagree. Cumulative counts get a `_total` suffix
(server.metrics turns those into counters); everything else is a gauge.
Failures are the metrics collector's to swallow: a scrape never fails.
"""

from __future__ import annotations

from typing import Any

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


def expert_cache_numbers(engine: Any) -> dict[str, Any]:
    """/cache/stats without per-layer lists: counters since start, gauges for the
    occupancy and for the last-N-tokens window."""
    from .routes.cache import stats_response

    if getattr(engine, "loaded", None) is None:
        return {}
    data = stats_response(engine, layers=False).model_dump()
    since = data.pop("since_start", None) or {}
    for key, value in since.items():
        data[f"{key}_total" if key in _CACHE_CUMULATIVE else f"lifetime_{key}"] = value
    data.pop("moe_layers", None)  # a list of layer indices: its count is in the config
    data.pop("batch_size", None)  # the engine's own flashserve_batch_size
    return data


def memory_numbers(engine: Any) -> dict[str, Any]:
    """The /memory report: RSS, system and MLX memory, resident vs streamed layers,
    streaming stats (nested dicts become name_key gauges, lists their lengths)."""
    from engine.memory import memory_report

    loaded = getattr(engine, "loaded", None)
    if loaded is None:
        return {}
    return memory_report(loaded, kv_cache_bytes=engine.stats.kv_cache_bytes).to_dict()
