"""Each request's draft length, from what speculation measurably gains it.

A pass over k drafted tokens yields on average E(k) = (1 - a^(k+1)) / (1 - a)
tokens for a per-token acceptance a, and costs c(k) = 1 + b*k plain passes.
Both are measured: a per request (a running mean of accepted / drafted), b
for the model (a running mean of (t(k) / t(0) - 1) / k over pass times,
t(0) from plain passes). When weights stream from disk a pass is I/O-bound
and b is near 0; on a resident model, or an MoE whose drafted tokens route to
more experts than the cache holds, b is larger. The draft length is the k
that maximises E(k) / c(k); when none beats 1 (k = 0), the request stops
speculating for a while, and probes again after a pause that doubles each
time the probe does not pay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flashserve.engine.speculative.accept import Sampling
from flashserve.engine.speculative.lookup import NgramIndex

SMOOTHING = 0.3  # weight of the newest pass in the running means
PRIOR_ACCEPTANCE = 0.6  # a new request's assumed acceptance: speculate from the start
PRIOR_SLOPE = 0.05  # the assumed extra cost per drafted token, before one is measured
FIRST_PAUSE = 8  # passes without speculation after it stopped paying
MAX_PAUSE = 256


@dataclass
class SpeculativeStats:
    """Counters for /health and /metrics (the worker's stats hold one)."""

    passes: int = 0  # verification passes (one per batch step that speculated)
    drafted_tokens: int = 0  # draft tokens verified, all sequences
    accepted_tokens: int = 0  # of which accepted
    emitted_tokens: int = 0  # tokens out of verification passes, per sequence summed
    sequence_passes: int = 0  # (sequence, pass) pairs: emitted / this = tokens per pass
    paused: int = 0  # times a request stopped speculating because it did not pay
    cost_slope: float = PRIOR_SLOPE  # measured extra cost of a pass per drafted token
    acceptance_rate: float = 0.0  # accepted / drafted, since start
    tokens_per_pass: float = 0.0  # emitted / sequence_passes: tokens a sequence gets per pass

    def refresh(self) -> None:
        """The rates from the counters (fields, so /health's dict carries them)."""
        self.acceptance_rate = self.accepted_tokens / max(self.drafted_tokens, 1)
        self.tokens_per_pass = self.emitted_tokens / max(self.sequence_passes, 1)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a pass over k drafts emits on average (the last one is always new)."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def best_length(acceptance: float, slope: float, max_draft: int) -> int:
    """The draft length with the most tokens per unit of pass time; 0: do not speculate."""
    gains = [expected_tokens(acceptance, k) / (1.0 + slope * k) for k in range(max_draft + 1)]
    best = int(np.argmax(gains))
    return best if gains[best] > 1.0 else 0


@dataclass
class Sequence:
    """One sequence's speculation: its drafts, its acceptance, its pauses."""

    max_draft: int
    sampling: Sampling | None = None  # None: greedy
    index: NgramIndex = field(default_factory=NgramIndex)
    acceptance: float = PRIOR_ACCEPTANCE
    pause: int = 0  # passes left without speculation
    next_pause: int = FIRST_PAUSE
    rng: np.random.Generator | None = None

    def __post_init__(self) -> None:
        if self.sampling is not None:
            self.rng = np.random.default_rng(self.sampling.seed)

    def draft(self, context: list[int], slope: float, room: int) -> list[int]:
        """This pass's draft (maybe empty) for the context so far; room: tokens the
        request may still emit after the pending one."""
        k = min(best_length(self.acceptance, slope, self.max_draft), room)
        if self.pause > 0:
            self.pause -= 1
            k = 0
        elif k == 0 and room > 0:
            # A probe after a pause: one short draft, to see if it pays now.
            k = min(2, room, self.max_draft)
        return self.index.draft(context, k)

    def update(self, drafted: int, accepted: int, slope: float) -> bool:
        """Record a pass; True when the request stops speculating for a while."""
        if drafted == 0:
            return False
        self.acceptance += SMOOTHING * (accepted / drafted - self.acceptance)
        if best_length(self.acceptance, slope, self.max_draft) > 0:
            self.next_pause = FIRST_PAUSE
            return False
        self.pause = self.next_pause
        self.next_pause = min(2 * self.next_pause, MAX_PAUSE)
        return True


class CostModel:
    """Pass times, plain and speculative, as the slope of cost per drafted token."""

    def __init__(self, stats: SpeculativeStats) -> None:
        self.stats = stats
        self.plain_s: float | None = None  # running mean of a plain pass's time

    def plain(self, seconds: float) -> None:
        if self.plain_s is None:
            self.plain_s = seconds
        else:
            self.plain_s += SMOOTHING * (seconds - self.plain_s)

    def speculative(self, seconds: float, drafts: int) -> None:
        if self.plain_s is None or drafts <= 0:
            return
        slope = max(0.0, (seconds / self.plain_s - 1.0) / drafts)
        self.stats.cost_slope += SMOOTHING * (slope - self.stats.cost_slope)
