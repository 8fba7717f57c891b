"""Whether a batch drafts this step, and how far: from what drafting measurably gains it.

A verification pass runs every sequence of the batch, padded to the longest
draft, so its cost is the batch's: T(B, k), the time of a step of B sequences
with k drafted tokens, against T(B, 0) for a plain step, which gives each
sequence one token. A sequence whose draft source finds a draft (probability
f) gets E(a, k) = (1 - a^(k+1)) / (1 - a) tokens from the pass, for a
per-token acceptance a; one without gets one token, as from a plain step.
Each step the batch takes the k with the most expected tokens per second over
all its sequences, and drafts only when that beats plain steps by MIN_GAIN;
otherwise the step is mlx-lm's plain one (pipelined: nothing waits for the
pending tokens), so drafting is off for a batch where it does not pay, even
when one of its sequences would gain alone.

Everything is measured, per batch size:

* T(B, k): the median of the last SAMPLES step times of each width run. A
  width not run yet at this size is estimated from another size's measured
  ratio to a plain step, else from the longest shorter width run plus
  PRIOR_SLOPE plain steps per token; widths are explored upwards, doubling,
  so a costly long pass is met once.
* f and a per sequence, from its passes; and, for prompt lookup, from shadow
  drafts while its batch does not draft: the draft lookup would have made is
  compared with the tokens the model then produced (greedy: what a pass would
  have accepted; sampled: a match is as likely as an acceptance), so a batch
  starts drafting when its output begins to repeat, at no cost to plain steps.

Estimates go stale (a cost measured while the machine was busy, a draft
model's acceptance, which has no shadow): a batch that does not draft tries a
pass again after FIRST_PAUSE steps, then after twice as many each time it
still does not pay (at most MAX_PAUSE).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flashserve.engine.speculative.accept import Sampling
from flashserve.engine.speculative.lookup import NgramIndex

SMOOTHING = 0.3  # weight of the newest observation in a sequence's running estimates
PRIOR_ACCEPTANCE = 0.6  # a new sequence's assumed per-token acceptance
PRIOR_WEIGHT = 2.0  # ... worth this many drafted tokens of evidence
PRIOR_SLOPE = 0.05  # the assumed extra cost of one more drafted token, in plain steps
SAMPLES = 5  # step times kept per (batch size, width); one slowed by other work is outvoted
FIRST_PAUSE = 8  # plain steps before a batch whose drafting does not pay tries again
MAX_PAUSE = 256
# Expected tokens per second must beat plain steps' by this factor: the margin
# covers what the estimate leaves out (waiting for the pending tokens, noise).
MIN_GAIN = 1.1


@dataclass
class SpeculativeStats:
    """Counters for /health and /metrics (the worker's stats hold one)."""

    passes: int = 0  # verification passes (one per batch step that speculated)
    drafted_tokens: int = 0  # draft tokens verified, all sequences
    accepted_tokens: int = 0  # of which accepted
    emitted_tokens: int = 0  # tokens out of verification passes, per sequence summed
    sequence_passes: int = 0  # (sequence, pass) pairs: emitted / this = tokens per pass
    paused: int = 0  # times a batch stopped drafting because it did not pay
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


@dataclass
class Sequence:
    """One sequence's speculation: its draft source's state and what it gains."""

    sampling: Sampling | None = None  # None: greedy
    shadowed: bool = False  # estimates also from shadow drafts (prompt lookup alone)
    index: NgramIndex = field(default_factory=NgramIndex)
    found: float = 1.0  # running mean: its draft source found a draft when asked
    accepted: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT  # decayed counts of accepted tokens
    rejected: float = (1 - PRIOR_ACCEPTANCE) * PRIOR_WEIGHT  # ... and of rejections
    rng: np.random.Generator | None = None
    draft_state: Any = None  # the draft model's cache for this sequence (draft.py)
    shadow: tuple[int, list[int]] | None = None  # (position it drafts for, draft)

    def __post_init__(self) -> None:
        if self.sampling is not None:
            self.rng = np.random.default_rng(self.sampling.seed)

    @property
    def acceptance(self) -> float:
        """Per-token acceptance: accepted tokens over accepted tokens and rejections
        (a draft stops at its first rejection)."""
        return self.accepted / (self.accepted + self.rejected)

    def record_lookup(self, found: bool) -> None:
        self.found += SMOOTHING * (float(found) - self.found)

    def record_draft(self, drafted: int, accepted: int) -> None:
        """A draft of `drafted` tokens whose first `accepted` were right."""
        if drafted == 0:
            return
        self.accepted = (1 - SMOOTHING) * self.accepted + accepted
        self.rejected = (1 - SMOOTHING) * self.rejected + float(accepted < drafted)

    def observe(self, context: list[int]) -> None:
        """Judge the outstanding shadow draft against `context` (the tokens run so far)
        once the tokens it guessed are known."""
        if self.shadow is None:
            return
        start, draft = self.shadow
        produced = context[start : start + len(draft)]
        right = 0
        while right < len(produced) and produced[right] == draft[right]:
            right += 1
        if right == len(produced) < len(draft):
            return  # every token known so far is right; the rest are not out yet
        self.record_draft(len(draft), right)
        self.shadow = None

    def start_shadow(self, context: list[int], k: int) -> None:
        """During a plain step: the draft a pass after `context` (the tokens run so far)
        would have verified, kept to be judged by observe()."""
        if self.shadow is not None:
            return
        draft = self.index.draft(context, k)
        self.record_lookup(bool(draft))
        if draft:
            self.shadow = (len(context), draft)


class CostModel:
    """Step times per batch size and draft width, and the per-step plan.

    A step's time runs from its start to the next step's start; a step that
    waits for the pending tokens (to draft after them) starts after that wait,
    which is the previous step's computation. A verification pass is over when
    its step returns, so it is recorded before the next step is planned. The
    worker's handling of the tokens a step emitted counts in it (more tokens,
    more handling). An interval across a change of the batch (a request
    joining, leaving, or the worker waiting for one) is not a step's time and
    is dropped.
    """

    def __init__(self, max_draft: int) -> None:
        self.max_draft = max_draft
        self._samples: dict[tuple[int, int], deque[float]] = {}
        self._open: tuple[float, int, tuple[int, ...]] | None = None  # start, width, uids
        self._paying = True  # the last plan found a width that pays
        self._pause = 0  # plain steps left before a batch that does not pay tries again
        self._next_pause = FIRST_PAUSE
        self.stops = 0  # times drafting stopped paying (SpeculativeStats.paused)

    def begin(self, now: float, width: int, uids: tuple[int, ...]) -> None:
        """A step of `width` drafted tokens (0: plain) starts now; the open one ends."""
        self.end(now, uids)
        self._open = (now, width, uids)

    def end(self, now: float, uids: tuple[int, ...]) -> None:
        """The open step ends now; its time is recorded if the batch is the same."""
        if self._open is not None:
            start, width, batch = self._open
            if batch == uids:
                key = (len(uids), width)
                self._samples.setdefault(key, deque(maxlen=SAMPLES)).append(now - start)
        self._open = None

    @property
    def drafting(self) -> bool:
        """Whether the open step is a verification pass (it ran to its end: nothing of
        it is left in flight when the next step starts)."""
        return self._open is not None and self._open[1] > 0

    def estimate(self, batch: int, width: int) -> float:
        """A step's time, measured or estimated; inf for a width not to be tried yet."""
        plain = self._median(batch, 0)
        run = {w: self._median(b, w) for b, w in self._samples if b == batch and w > 0}
        floor = max([plain, *(s for w, s in run.items() if w < width)])
        if width in run:  # never below a shorter pass's: a longer one does its work too
            return max(run[width], floor)
        if width > max(2, 2 * max(run, default=1)):
            return math.inf
        for _, b in sorted((abs(b - batch), b) for b, w in self._samples if w == width):
            if (b, 0) in self._samples:  # that batch size's measured ratio to a plain step
                return max(plain * self._median(b, width) / self._median(b, 0), floor)
        below = max((w for w in run if w < width), default=0)
        base = run.get(below, plain)
        return max(base + PRIOR_SLOPE * plain * (width - below), floor)

    def _median(self, batch: int, width: int) -> float:
        return statistics.median(self._samples[batch, width])

    def plan(self, batch: int, candidates: list[tuple[float, float, int]]) -> int:
        """This step's draft width (0: a plain step) for a batch of `batch` sequences, of
        which `candidates` may draft: (found, acceptance, tokens of room after the
        pending one) each."""
        if (batch, 0) not in self._samples or not candidates:
            return 0  # a plain step first: the yardstick
        plain = self._median(batch, 0)
        run = {w for b, w in self._samples if b == batch and w > 0}
        widths = sorted({1, 2, 4, 8, 16, 32, 64, *run})
        best, best_rate = 0, 0.0
        retry, retry_rate = 1, 0.0  # the best width run already: what a try re-measures
        for width in (w for w in widths if 0 < w <= self.max_draft):
            seconds = self.estimate(batch, width)
            if seconds == math.inf:
                break
            gain, none = 0.0, 1.0
            for found, acceptance, room in candidates:
                k = min(width, room)
                gain += found * (expected_tokens(acceptance, k) - 1.0)
                none *= 1.0 - found
            rate = (batch + gain) / ((1.0 - none) * seconds + none * plain)
            if rate > best_rate:
                best, best_rate = width, rate
            if width in run and rate > retry_rate:
                retry, retry_rate = width, rate
        if best_rate > MIN_GAIN * batch / plain:
            self._paying, self._next_pause = True, FIRST_PAUSE
            return best
        if self._paying:  # it stopped paying: plain steps, then a try
            self._paying, self._pause = False, self._next_pause
            self.stops += 1
        if self._pause > 0:
            self._pause -= 1
            return 0
        # A try at the most promising width already run: it measures that cost again
        # (exploring a longer one waits until the estimates say it pays).
        self._pause = self._next_pause = min(2 * self._next_pause, MAX_PAUSE)
        return retry
