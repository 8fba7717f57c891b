"""Each request's draft length, from what speculation measurably gains it.

A pass over k drafted tokens yields on average E(k) = (1 - a^(k+1)) / (1 - a)
tokens for a per-token acceptance a, and costs c(k) plain passes. Both are
measured: a per request (a running mean of accepted / drafted), c(k) for the
model as the running mean of a (k+1)-token pass's time over a plain pass's.
When weights stream from disk a pass is I/O-bound and c(k) stays near 1; on
a resident model on the CPU, or an MoE whose drafted tokens route to more
experts than the cache holds, it grows, and not linearly (kernels change
with the row count). A length not measured yet is estimated from the longest
shorter one measured plus PRIOR_SLOPE per token, so it gets tried once and
then judged on its measured cost. The draft length is the k that maximises
E(k) / c(k); when none beats 1 (k = 0), the request stops speculating for a
while, and probes again after a pause that doubles each time the probe does
not pay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flashserve.engine.speculative.accept import Sampling
from flashserve.engine.speculative.lookup import NgramIndex

SMOOTHING = 0.3  # weight of the newest pass in the running means
PRIOR_ACCEPTANCE = 0.6  # a new request's assumed acceptance: speculate from the start
PRIOR_SLOPE = 0.05  # the assumed extra cost of one more drafted token, before measured
FIRST_PAUSE = 8  # passes without speculation after it stopped paying
MAX_PAUSE = 256
# A draft length must promise this many times a plain pass's tokens per second:
# the margin covers what the estimate leaves out (drafting, the accept loop).
MIN_GAIN = 1.1


@dataclass
class SpeculativeStats:
    """Counters for /health and /metrics (the worker's stats hold one)."""

    passes: int = 0  # verification passes (one per batch step that speculated)
    drafted_tokens: int = 0  # draft tokens verified, all sequences
    accepted_tokens: int = 0  # of which accepted
    emitted_tokens: int = 0  # tokens out of verification passes, per sequence summed
    sequence_passes: int = 0  # (sequence, pass) pairs: emitted / this = tokens per pass
    paused: int = 0  # times a request stopped speculating because it did not pay
    recompute_passes: int = 0  # hybrid models: passes re-running kept tokens after a rejection
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


def best_length(acceptance: float, costs: list[float]) -> int:
    """The draft length with the most tokens per unit of pass time (costs[k]: a pass
    over k drafts in plain passes, costs[0] = 1); 0: do not speculate."""
    gains = [expected_tokens(acceptance, k) / max(c, 1e-9) for k, c in enumerate(costs)]
    best = int(np.argmax(gains))
    return best if gains[best] > MIN_GAIN else 0


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
    draft_state: Any = None  # the draft model's cache for this sequence (draft.py)

    def __post_init__(self) -> None:
        if self.sampling is not None:
            self.rng = np.random.default_rng(self.sampling.seed)

    def length(self, costs: list[float], room: int) -> int:
        """This pass's draft length (0: none); room: tokens the request may still emit
        after the pending one."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        k = min(best_length(self.acceptance, costs[: self.max_draft + 1]), room)
        if k == 0 and room > 0:
            # A probe after a pause: one short draft, to see if it pays now.
            k = min(2, room, self.max_draft)
        return k

    def update(self, drafted: int, accepted: int, costs: list[float]) -> bool:
        """Record a pass; True when the request stops speculating for a while."""
        if drafted == 0:
            return False
        self.acceptance += SMOOTHING * (accepted / drafted - self.acceptance)
        if best_length(self.acceptance, costs[: self.max_draft + 1]) > 0:
            self.next_pause = FIRST_PAUSE
            return False
        self.pause = self.next_pause
        self.next_pause = min(2 * self.next_pause, MAX_PAUSE)
        return True


class CostModel:
    """Step times, plain and speculative, as each draft length's cost in plain steps.

    A step's time is from its start to the next step's start: the worker's
    handling of the tokens it emitted counts (more tokens, more handling), and
    mlx-lm's pipelined plain step is charged what it really takes. An interval
    across a change of the batch (a request joining, leaving, or the worker
    waiting for one) is not a step's time and is dropped.
    """

    def __init__(self, max_draft: int) -> None:
        self.plain_s: float | None = None  # running mean of a plain step's time
        self.measured: dict[int, float] = {}  # drafts -> running mean of cost
        self.costs: list[float] = []  # drafts k = 0.. -> cost in plain steps (inf: not yet)
        self._open: tuple[float, int, tuple[int, ...]] | None = None  # start, drafts, uids
        self._refresh(max_draft)

    def step(self, now: float, drafts: int, uids: tuple[int, ...]) -> None:
        """A step starts now (with `drafts` drafted tokens at most): the previous ends."""
        if self._open is not None:
            start, previous, batch = self._open
            if batch == uids:
                self._record(now - start, previous)
        self._open = (now, drafts, uids)

    def _record(self, seconds: float, drafts: int) -> None:
        if drafts == 0:
            if self.plain_s is None:
                self.plain_s = seconds
            else:
                self.plain_s += SMOOTHING * (seconds - self.plain_s)
            return
        if self.plain_s is None:
            return
        cost = seconds / self.plain_s
        old = self.measured.get(drafts)
        self.measured[drafts] = cost if old is None else old + SMOOTHING * (cost - old)
        self._refresh(len(self.costs) - 1)

    def _refresh(self, max_draft: int) -> None:
        # Lengths are explored upwards, doubling: one not measured is a candidate
        # only up to twice the longest measured (2 at first), so a costly long
        # pass is met once, after the cheaper ones have shown what they gain.
        reach = max(2, 2 * max(self.measured, default=1))
        costs, last = [1.0], 1.0
        for k in range(1, max_draft + 1):
            # Never below the shorter draft's: a longer pass does at least its work.
            guess = last + PRIOR_SLOPE if k <= reach else float("inf")
            last = max(self.measured.get(k, guess), last)
            costs.append(last)
        self.costs = costs
