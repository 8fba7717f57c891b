"""Expert-cache counters and the payload of GET /cache/stats.

The worker thread adds to a per-layer counter matrix; readers (the HTTP route,
polled every second by dashboards) copy it under a lock that is only ever held
for a few-kilobyte numpy copy, so reading never blocks generation for longer
than a memcpy and never runs MLX.

Two views: since start, and a window over the last N tokens (a ring of
per-token deltas; `reset_window` empties it).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import numpy as np

# Per-layer counters (columns of the counter matrix).
HITS = 0  # needed expert found in the cache
PREFETCH_HITS = 1  # needed expert found among next-layer prefetches
MISSES = 2  # needed expert read on demand
EVICTIONS = 3
BYTES_READ = 4  # demand + prefetch
DEMAND_BYTES = 5
DEMAND_SECONDS = 6  # wall time of demand read batches (submit -> last byte)
BLOCKED_SECONDS = 7  # worker waiting on expert I/O (demand + unfinished prefetch)
PREDICTED = 8  # experts predicted for this layer by the previous layer's prefetch
PREDICTED_CORRECT = 9
PREDICTED_ACTUAL = 10  # experts needed in calls that had a prediction
PREFETCH_READS = 11
PREFETCH_BYTES = 12
PREFETCH_WASTED = 13  # prefetched, then not needed
PREFETCH_WASTED_BYTES = 14
CALLS = 15  # layer calls (forwards through this MoE layer)
TOKENS = 16  # tokens routed through this layer
USES = 17  # (token, expert) routings: tokens x experts per token
N_COUNTERS = 18

# Global counters.
G_FORWARDS = 0
G_TOKENS = 1
G_TOKEN_SECONDS = 2  # wall time between forwards, idle gaps excluded
N_GLOBAL = 3

IDLE_GAP_S = 10.0  # a gap between forwards longer than this is idle time, not token time


@dataclass
class LayerStats:
    layer: int
    hits: int
    prefetch_hits: int
    misses: int
    hit_rate: float  # hits / accesses (prefetch hits count as misses here)
    served_without_demand_read: float  # (hits + prefetch hits) / accesses
    evictions: int
    bytes_read: int
    read_gb_per_s: float  # demand bytes / wall time of demand reads
    blocked_s: float
    prefetch_precision: float | None
    prefetch_recall: float | None
    prefetch_reads: int
    prefetch_bytes: int
    prefetch_wasted: int
    prefetch_wasted_bytes: int
    resident_experts: int
    resident_bytes: int


@dataclass
class StatsView:
    """Counters over some span: since start, or the last N tokens."""

    tokens: int
    forwards: int
    token_seconds: float
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
    io_wait_share: float  # blocked time / token time
    prefetch_precision: float | None
    prefetch_recall: float | None
    prefetch_reads: int
    prefetch_bytes: int
    prefetch_wasted: int
    prefetch_wasted_bytes: int
    layers: list[LayerStats] = field(default_factory=list)


@dataclass
class StepView:
    """The last finished forward pass: a decode step of the whole batch, or a prefill chunk.

    A step looks each needed expert up once, whatever the number of tokens
    routed to it, so `uses_per_needed_expert` is how far the batch shares its
    expert loads (1.0 with one token, up to the batch size).
    """

    tokens: int  # tokens in the step: the sequences of a decode step
    expert_uses: int  # (token, expert) routings, all MoE layers
    experts_needed: int  # distinct experts per layer, summed over layers
    expert_reads: int  # needed experts read from disk on demand
    bytes_read: int
    uses_per_needed_expert: float


@dataclass
class CacheStats:
    """What GET /cache/stats returns (asdict -> JSON)."""

    policy: str
    prefetch: str
    capacity_slots: int | None
    capacity_bytes: int | None
    occupancy_slots: int
    occupancy_bytes: int
    occupancy_fraction: float  # of the capacity (slots or bytes, whichever it is set in)
    total_experts: int
    expert_bytes: int  # bytes of one expert record (largest layer)
    moe_layers: list[int]
    io_threads: int
    window_tokens: int  # N of the window
    uptime_s: float
    since_start: StatsView
    window: StatsView
    last_step: StepView

    def to_dict(self) -> dict:
        return asdict(self)


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else 0.0


def _maybe_ratio(num: float, den: float) -> float | None:
    return float(num) / float(den) if den else None


class ExpertStats:
    def __init__(self, layers: list[int], window_tokens: int = 256) -> None:
        self.layers = list(layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.window_tokens = window_tokens
        self._lock = threading.Lock()
        self._total = np.zeros((len(layers), N_COUNTERS))
        self._gtotal = np.zeros(N_GLOBAL)
        # The forward in progress: folded into totals and the window when the
        # next forward starts (or a reader asks).
        self._cur = np.zeros((len(layers), N_COUNTERS))
        self._gcur = np.zeros(N_GLOBAL)
        self._ring: deque[tuple[np.ndarray, np.ndarray]] = deque()
        self._ring_tokens = 0
        self._wsum = np.zeros((len(layers), N_COUNTERS))
        self._gwsum = np.zeros(N_GLOBAL)
        self._last = np.zeros((len(layers), N_COUNTERS))  # the last folded forward
        self._glast = np.zeros(N_GLOBAL)
        self._resident = np.zeros((len(layers), 2))  # experts, bytes
        self._last_forward: float | None = None
        self._started = time.time()

    # -- worker side --------------------------------------------------------------

    def add(self, layer: int, counter: int, value: float = 1.0) -> None:
        with self._lock:
            self._cur[self.row[layer], counter] += value

    def add_many(self, layer: int, values: dict[int, float]) -> None:
        r = self.row[layer]
        with self._lock:
            for counter, value in values.items():
                self._cur[r, counter] += value

    def resident(self, layer: int, experts_delta: int, bytes_delta: int) -> None:
        with self._lock:
            self._resident[self.row[layer]] += (experts_delta, bytes_delta)

    def clear_resident(self) -> None:
        with self._lock:
            self._resident[:] = 0

    def forward_started(self, tokens: int) -> None:
        """A forward pass reached its first MoE layer with `tokens` tokens."""
        now = time.perf_counter()
        with self._lock:
            if self._last_forward is not None:
                gap = now - self._last_forward
                if gap < IDLE_GAP_S:
                    self._gcur[G_TOKEN_SECONDS] += gap
            self._fold()
            self._gcur[G_FORWARDS] += 1
            self._gcur[G_TOKENS] += tokens
            self._last_forward = now

    def _fold(self) -> None:
        # Lock held. A forward of T tokens enters the window as one entry of T tokens.
        tokens = int(self._gcur[G_TOKENS])
        if not self._cur.any() and not self._gcur.any():
            return
        self._total += self._cur
        self._gtotal += self._gcur
        self._ring.append((self._cur, self._gcur))
        self._wsum += self._cur
        self._gwsum += self._gcur
        self._ring_tokens += tokens
        self._last, self._glast = self._cur, self._gcur
        while len(self._ring) > 1 and self._ring_tokens - int(self._ring[0][1][G_TOKENS]) >= (
            self.window_tokens
        ):
            old, gold = self._ring.popleft()
            self._wsum -= old
            self._gwsum -= gold
            self._ring_tokens -= int(gold[G_TOKENS])
        self._cur = np.zeros_like(self._cur)
        self._gcur = np.zeros_like(self._gcur)

    # -- reader side ----------------------------------------------------------------

    def reset_window(self) -> None:
        with self._lock:
            self._ring.clear()
            self._ring_tokens = 0
            self._wsum[:] = 0
            self._gwsum[:] = 0
            # Counters of the forward in progress belong to the new window only.
            self._total += self._cur
            self._gtotal += self._gcur
            self._cur = np.zeros_like(self._cur)
            self._gcur = np.zeros_like(self._gcur)

    def reset(self) -> None:
        """Zero everything (bench: between configurations)."""
        with self._lock:
            for a in (self._total, self._gtotal, self._cur, self._gcur, self._wsum, self._gwsum):
                a[:] = 0
            self._last = np.zeros_like(self._last)
            self._glast = np.zeros_like(self._glast)
            self._ring.clear()
            self._ring_tokens = 0
            self._last_forward = None

    def copy(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(total, global total, window, global window, resident), the open forward included."""
        with self._lock:
            return (
                self._total + self._cur,
                self._gtotal + self._gcur,
                self._wsum + self._cur,
                self._gwsum + self._gcur,
                self._resident.copy(),
            )

    def step_view(self) -> StepView:
        with self._lock:
            s, g = self._last.sum(axis=0), self._glast.copy()
        needed = s[HITS] + s[PREFETCH_HITS] + s[MISSES]
        return StepView(
            tokens=int(g[G_TOKENS]),
            expert_uses=int(s[USES]),
            experts_needed=int(needed),
            expert_reads=int(s[MISSES]),
            bytes_read=int(s[BYTES_READ]),
            uses_per_needed_expert=_ratio(s[USES], needed),
        )

    def view(self, counts: np.ndarray, gcounts: np.ndarray, resident: np.ndarray) -> StatsView:
        layers = [
            self._layer_stats(layer, counts[i], resident[i]) for i, layer in enumerate(self.layers)
        ]
        s = counts.sum(axis=0)
        tokens = int(gcounts[G_TOKENS])
        accesses = s[HITS] + s[PREFETCH_HITS] + s[MISSES]
        return StatsView(
            tokens=tokens,
            forwards=int(gcounts[G_FORWARDS]),
            token_seconds=float(gcounts[G_TOKEN_SECONDS]),
            hits=int(s[HITS]),
            prefetch_hits=int(s[PREFETCH_HITS]),
            misses=int(s[MISSES]),
            hit_rate=_ratio(s[HITS], accesses),
            served_without_demand_read=_ratio(s[HITS] + s[PREFETCH_HITS], accesses),
            evictions=int(s[EVICTIONS]),
            bytes_read=int(s[BYTES_READ]),
            bytes_read_per_token=_ratio(s[BYTES_READ], tokens),
            read_gb_per_s=_ratio(s[DEMAND_BYTES], s[DEMAND_SECONDS]) / 1e9,
            blocked_s=float(s[BLOCKED_SECONDS]),
            io_wait_share=min(_ratio(s[BLOCKED_SECONDS], gcounts[G_TOKEN_SECONDS]), 1.0),
            prefetch_precision=_maybe_ratio(s[PREDICTED_CORRECT], s[PREDICTED]),
            prefetch_recall=_maybe_ratio(s[PREDICTED_CORRECT], s[PREDICTED_ACTUAL]),
            prefetch_reads=int(s[PREFETCH_READS]),
            prefetch_bytes=int(s[PREFETCH_BYTES]),
            prefetch_wasted=int(s[PREFETCH_WASTED]),
            prefetch_wasted_bytes=int(s[PREFETCH_WASTED_BYTES]),
            layers=layers,
        )

    @staticmethod
    def _layer_stats(layer: int, c: np.ndarray, resident: np.ndarray) -> LayerStats:
        accesses = c[HITS] + c[PREFETCH_HITS] + c[MISSES]
        return LayerStats(
            layer=layer,
            hits=int(c[HITS]),
            prefetch_hits=int(c[PREFETCH_HITS]),
            misses=int(c[MISSES]),
            hit_rate=_ratio(c[HITS], accesses),
            served_without_demand_read=_ratio(c[HITS] + c[PREFETCH_HITS], accesses),
            evictions=int(c[EVICTIONS]),
            bytes_read=int(c[BYTES_READ]),
            read_gb_per_s=_ratio(c[DEMAND_BYTES], c[DEMAND_SECONDS]) / 1e9,
            blocked_s=float(c[BLOCKED_SECONDS]),
            prefetch_precision=_maybe_ratio(c[PREDICTED_CORRECT], c[PREDICTED]),
            prefetch_recall=_maybe_ratio(c[PREDICTED_CORRECT], c[PREDICTED_ACTUAL]),
            prefetch_reads=int(c[PREFETCH_READS]),
            prefetch_bytes=int(c[PREFETCH_BYTES]),
            prefetch_wasted=int(c[PREFETCH_WASTED]),
            prefetch_wasted_bytes=int(c[PREFETCH_WASTED_BYTES]),
            resident_experts=int(resident[0]),
            resident_bytes=int(resident[1]),
        )

    def uptime(self) -> float:
        return time.time() - self._started
