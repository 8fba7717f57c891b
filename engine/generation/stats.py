"""The worker's counters, read by /health, /metrics and the benchmark."""

from __future__ import annotations

import time
from dataclasses import astuple, dataclass, field

from flashserve.engine.speculative.adaptive import SpeculativeStats
from flashserve.engine.weights.model import LoadedModel

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # max_batch is at most 256


@dataclass
class TtftParts:
    """Where one request's time to first token went, in seconds; they add up to it.

    queue_wait: submitted until the worker took it; cache_lookup: its prompt
    looked up in the prompt cache (and a hit restored), processors built;
    image_encode: its images through the vision tower on their own thread (0
    without images, or when the prompt cache covered them);
    prefill: the prompt's uncached tokens run, until the logits of its last one;
    first_step: from there to the first token out (sampling, the first decode
    step of the batch it joined).
    """

    queue_wait_s: float = 0.0
    cache_lookup_s: float = 0.0
    image_encode_s: float = 0.0
    prefill_s: float = 0.0
    first_step_s: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(astuple(self))


@dataclass
class TtftStats:
    """The last request's parts, and their sums over every request with a first token
    (/metrics serves the sums as counters: rate(part) / rate(requests) is its mean)."""

    requests: int = 0
    last: TtftParts = field(default_factory=TtftParts)
    last_total_s: float = 0.0
    total: TtftParts = field(default_factory=TtftParts)
    total_s: float = 0.0

    def add(self, parts: TtftParts) -> None:
        self.requests += 1
        self.last, self.last_total_s = parts, parts.total_s
        self.total = TtftParts(
            *(a + b for a, b in zip(astuple(self.total), astuple(parts), strict=True))
        )
        self.total_s += parts.total_s


@dataclass
class WorkerStats:
    requests_total: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0
    prompt_tokens_total: int = 0
    # Prompt tokens run through prefill (not restored from the prompt cache): once
    # per request, however many choices share the prefill.
    prefill_tokens_total: int = 0
    completion_tokens_total: int = 0
    queued: int = 0
    active: int = 0  # sequences (choices) in the batch now
    batch_size: int = 0  # sequences in the last decode step
    steps: int = 0  # decode steps since start
    batch_size_sum: int = 0  # sequences over all decode steps (their mean: sum / steps)
    # Decode steps by batch size, one count per BATCH_SIZE_BUCKETS upper bound (not
    # cumulative): /metrics serves it as a histogram.
    batch_size_steps: list[int] = field(default_factory=lambda: [0] * len(BATCH_SIZE_BUCKETS))
    kv_cache_bytes: int = 0  # KV cache and recurrent state of the batch
    last_step_read_bytes: int = 0  # weights read from disk by the last step, for the batch
    last_prefill_tokens_per_s: float = 0.0
    last_decode_tokens_per_s: float = 0.0
    ttft: TtftStats = field(default_factory=TtftStats)
    speculative: SpeculativeStats = field(default_factory=SpeculativeStats)

    def record(
        self, prompt: int, generated: int, started: float, first_token_at: float | None
    ) -> None:
        """One ended sequence: its tokens, and the speeds of its prefill and decode."""
        end = time.perf_counter()
        first = first_token_at or end
        self.prompt_tokens_total += prompt
        self.completion_tokens_total += generated
        if prompt:
            self.last_prefill_tokens_per_s = prompt / max(first - started, 1e-9)
        if generated > 1:
            self.last_decode_tokens_per_s = (generated - 1) / max(end - first, 1e-9)


def weight_bytes_read(loaded: LoadedModel | None) -> int:
    """Weight bytes read from disk so far: streamed layers and offloaded experts."""
    total = 0
    if loaded is not None and loaded.streamer is not None:
        total += loaded.streamer.stats.bytes_read
    if loaded is not None and loaded.experts is not None:
        total += loaded.experts.snapshot().since_start.bytes_read
    return total
