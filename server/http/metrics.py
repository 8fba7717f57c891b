"""Prometheus metrics, one CollectorRegistry per app.

Three kinds of numbers end up on /metrics:
- HTTP and latency metrics the server observes itself (requests by route and
  status, request duration, time to first token, inter-token latency);
- engine counters read at scrape time from `Engine.stats_dict()`, the same
  numbers the JSON stats endpoints report, so the two never disagree;
- "sources": any callable returning a flat or nested dict of numbers
  (the expert-cache stats behind /cache/stats, the memory report behind
  /memory). `Metrics.add_source("expert_cache", fn)` turns every numeric
  leaf into a gauge, or a counter when its key ends in `_total`.

A per-app registry (not prometheus-client's global one) lets tests build
several apps in one process.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from flashserve.engine.generation.stats import BATCH_SIZE_BUCKETS

log = logging.getLogger(__name__)

PREFIX = "flashserve"

Source = Callable[[], Mapping[str, Any]]

# Latency buckets sized for a local server: CPU prefill of a long prompt can take
# tens of seconds, a decode step takes milliseconds to a second when streaming from SSD.
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(*parts: str) -> str:
    return _UNSAFE.sub("_", "_".join(p for p in parts if p))


Engines = Callable[[], Iterable[tuple[str, Any]]]  # each loaded model's engine, by name


def by_model(families: Mapping[str, Iterable[Metric]]) -> Iterator[Metric]:
    """Each model's metric families as one family per name, every sample labelled
    with its model (`model="NAME"`): a server with several models reports each."""
    merged: dict[str, Metric] = {}
    for model, metrics in families.items():
        for family in metrics:
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type)
            for sample in family.samples:
                labels = {"model": model, **sample.labels}
                out.samples.append(sample._replace(labels=labels))
    yield from merged.values()


class ModelSourceCollector(Collector):
    """A source per loaded model (its /cache/stats, its /memory), labelled by model."""

    def __init__(
        self, prefix: str, engines: Engines, fn: Callable[[Any], Mapping[str, Any]], doc: str
    ):
        self._engines = engines
        self._sources = (prefix, fn, doc)

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        prefix, fn, doc = self._sources
        families = {}
        for name, engine in self._engines():
            bound = SourceCollector(prefix, lambda engine=engine: fn(engine), doc)
            families[name] = list(bound.collect())
        yield from by_model(families)


class SourceCollector(Collector):
    """Numeric leaves of `fn()` as gauges (counters for keys ending in `_total`)."""

    def __init__(self, prefix: str, fn: Source, documentation: str = ""):
        self._prefix = prefix
        self._fn = fn
        self._doc = documentation or f"{prefix} statistic"

    def describe(self) -> Iterable[Metric]:
        # Nothing up front: the keys are only known once the source reports.
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            values = self._fn()
        except Exception as exc:  # a scrape must never fail because one source did
            log.debug("metrics source %s failed: %s", self._prefix, exc)
            return
        if not isinstance(values, Mapping):
            return
        for key, value in _numeric_leaves(values):
            name = metric_name(self._prefix, key)
            if key.endswith("_total"):
                yield CounterMetricFamily(name, self._doc, value=value)
            else:
                yield GaugeMetricFamily(name, self._doc, value=value)


def _numeric_leaves(values: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    for key, value in values.items():
        name = f"{prefix}_{key}" if prefix else str(key)
        if isinstance(value, bool):
            yield name, float(value)
        elif isinstance(value, (int, float)):
            if math.isfinite(value):
                yield name, float(value)
        elif isinstance(value, Mapping):
            yield from _numeric_leaves(value, name)
        elif isinstance(value, (list, tuple)):
            # e.g. resident_layers: [0, 1, 2] -> resident_layers_count 3
            yield f"{name}_count", float(len(value))


class EngineCollector(Collector):
    """Engine state and counters, read from `stats_dict()` at scrape time."""

    COUNTERS: ClassVar[dict[str, tuple[str, str]]] = {
        "requests_total": ("engine_requests_total", "Generations the worker started"),
        "requests_failed": ("engine_requests_failed_total", "Generations ended by an error"),
        "requests_cancelled": (
            "engine_requests_cancelled_total",
            "Generations cancelled (client gone, time limit, shutdown)",
        ),
        "prompt_tokens_total": ("prompt_tokens_total", "Prompt tokens processed (tokens in)"),
        "completion_tokens_total": ("completion_tokens_total", "Tokens generated (tokens out)"),
    }
    GAUGES: ClassVar[dict[str, tuple[str, str]]] = {
        "queued": ("queue_depth", "Requests waiting for the worker"),
        "active": ("generations_running", "Generations in the worker's batch"),
        "batch_size": ("batch_size", "Sequences in the last decode step"),
        "last_prefill_tokens_per_s": ("last_prefill_tokens_per_second", "Prefill speed, last"),
        "last_decode_tokens_per_s": ("last_decode_tokens_per_second", "Decode speed, last"),
    }

    def __init__(self, engines: Engines):
        self._engines = engines

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from by_model({name: self._one(engine) for name, engine in self._engines()})

    def _one(self, engine: Any) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            metric_name(PREFIX, "model_ready"),
            "1 when the model is loaded and serving",
            value=float(getattr(engine, "state", "") == "ready"),
        )
        try:
            stats = engine.stats_dict()
        except Exception as exc:
            log.debug("engine stats failed: %s", exc)
            return
        for key, (name, doc) in self.COUNTERS.items():
            if isinstance(stats.get(key), (int, float)):
                yield CounterMetricFamily(metric_name(PREFIX, name), doc, value=stats[key])
        for key, (name, doc) in self.GAUGES.items():
            if isinstance(stats.get(key), (int, float)):
                yield GaugeMetricFamily(metric_name(PREFIX, name), doc, value=stats[key])
        yield from _ttft_metrics(stats.get("ttft"))
        yield from _speculative_metrics(stats.get("speculative"))
        yield from _vision_metrics(getattr(getattr(engine, "loaded", None), "vision", None))
        steps = stats.get("batch_size_steps")
        if isinstance(steps, list) and len(steps) == len(BATCH_SIZE_BUCKETS):
            yield _batch_size_histogram(steps, stats.get("batch_size_sum", 0))


TTFT_PARTS = ("queue_wait_s", "cache_lookup_s", "image_encode_s", "prefill_s", "first_step_s")


def _vision_metrics(vision: Any) -> Iterator[Metric]:
    """A vision-language model's tower (engine/vision/tower.py): images it encoded."""
    if vision is None:
        return
    yield CounterMetricFamily(
        metric_name(PREFIX, "images_encoded"),
        "Images run through the vision tower (an image whose features or prompt state "
        "were cached is not)",
        value=vision.encodes,
    )
    yield CounterMetricFamily(
        metric_name(PREFIX, "image_encode_seconds"),
        "Seconds the vision tower spent encoding images (image processor included)",
        value=vision.encode_seconds,
    )


def _ttft_metrics(ttft: Any) -> Iterator[Metric]:
    """Time to first token in parts (engine/generation/stats.py, TtftParts): the sums
    as counters (a part's mean is rate(part) / rate(requests)), the last request's
    as gauges. The parts add up to the whole, so a slow first token is explained
    from /metrics alone."""
    if not isinstance(ttft, dict):
        return
    yield CounterMetricFamily(
        metric_name(PREFIX, "ttft_requests_total"),
        "Requests whose time to first token is split below",
        value=ttft["requests"],
    )
    for part in TTFT_PARTS:
        name = part.removesuffix("_s")
        yield CounterMetricFamily(
            metric_name(PREFIX, f"ttft_{name}_seconds_total"),
            f"Time to first token spent in {name.replace('_', ' ')}, summed over requests",
            value=ttft["total"][part],
        )
        yield GaugeMetricFamily(
            metric_name(PREFIX, f"last_ttft_{name}_seconds"),
            f"Time to first token spent in {name.replace('_', ' ')}, last request",
            value=ttft["last"][part],
        )
    yield GaugeMetricFamily(
        metric_name(PREFIX, "last_ttft_seconds"),
        "Time to first token of the last request, from submit (the parts' sum)",
        value=ttft["last_total_s"],
    )


SPECULATIVE_COUNTERS = {
    "passes": "Verification passes (batch steps that ran drafted tokens)",
    "drafted_tokens": "Drafted tokens verified",
    "accepted_tokens": "Drafted tokens accepted",
    "emitted_tokens": "Tokens emitted by verification passes, all sequences",
    "sequence_passes": "Sequences run by verification passes, summed over passes",
    "paused": "Times a batch stopped drafting because it did not pay",
    "recompute_passes": "Hybrid models: passes re-running kept tokens after a rejection",
}


def _speculative_metrics(spec: Any) -> Iterator[Metric]:
    """Speculative decoding (engine/speculative/): counters, and the rates since start
    (acceptance; tokens a sequence gets per verification pass)."""
    if not isinstance(spec, dict):
        return
    for key, doc in SPECULATIVE_COUNTERS.items():
        name = metric_name(PREFIX, f"speculative_{key}_total")
        yield CounterMetricFamily(name, doc, value=spec[key])
    yield GaugeMetricFamily(
        metric_name(PREFIX, "speculative_acceptance_rate"),
        "Drafted tokens accepted / drafted, since start",
        value=spec["acceptance_rate"],
    )
    yield GaugeMetricFamily(
        metric_name(PREFIX, "speculative_tokens_per_pass"),
        "Tokens a sequence gets per verification pass, since start",
        value=spec["tokens_per_pass"],
    )


def _batch_size_histogram(steps: list[int], total: int) -> HistogramMetricFamily:
    """Decode steps by batch size, from the worker's per-bucket counts."""
    buckets, seen = [], 0
    for bound, count in zip(BATCH_SIZE_BUCKETS, steps, strict=True):
        seen += count
        buckets.append((str(bound), seen))
    buckets.append(("+Inf", seen))
    return HistogramMetricFamily(
        metric_name(PREFIX, "decode_batch_size"),
        "Sequences per decode step (one observation per step)",
        buckets=buckets,
        sum_value=total,
    )


class Metrics:
    """The app's registry and the metrics the server observes itself."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            metric_name(PREFIX, "http_requests"),
            "HTTP requests by route template, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.http_duration = Histogram(
            metric_name(PREFIX, "http_request_duration_seconds"),
            "HTTP request duration, to the last byte of the body (streams included)",
            ["route"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            metric_name(PREFIX, "time_to_first_token_seconds"),
            "Submit to first generated token (includes time in the queue)",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            metric_name(PREFIX, "inter_token_latency_seconds"),
            "Time between consecutive generated tokens of one request",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.generations = Counter(
            metric_name(PREFIX, "generations"),
            "Finished generations by reason (stop, length, timeout, shutdown, cancelled, error)",
            ["reason"],
            registry=r,
        )
        self.in_flight = Gauge(
            metric_name(PREFIX, "requests_in_flight"),
            "Generations submitted and not finished (queued or running)",
            registry=r,
        )
        try:
            ProcessCollector(registry=r)  # process_resident_memory_bytes etc. (Linux /proc)
        except Exception as exc:  # pragma: no cover - platform without /proc
            log.debug("process metrics unavailable: %s", exc)

    def watch_engines(self, engines: Engines) -> None:
        """Every loaded model's engine counters, labelled by model."""
        self.registry.register(EngineCollector(engines))

    def add_model_source(
        self, name: str, engines: Engines, fn: Callable[[Any], Mapping[str, Any]], doc: str = ""
    ) -> None:
        """`fn(engine)` for every loaded model: `flashserve_<name>_<key>{model=...}`."""
        prefix = metric_name(PREFIX, name)
        self.registry.register(
            ModelSourceCollector(prefix, engines, fn, doc or f"{prefix} statistic")
        )

    def add_source(self, name: str, fn: Source, documentation: str = "") -> None:
        """Expose the numbers of `fn()` as `flashserve_<name>_<key>` at every scrape."""
        self.registry.register(SourceCollector(metric_name(PREFIX, name), fn, documentation))

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.http_requests.labels(route, method, str(status)).inc()
        self.http_duration.labels(route).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
