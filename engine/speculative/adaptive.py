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

* T(B, k) / T(B, 0): each pass's time over the median of the last
  PLAIN_SAMPLES plain steps of its size before it; the median of the last
  SAMPLES such ratios per width. A width not run yet at this size is
  estimated on the line through the two longest widths run below it (a plain
  step as width 0), else from the nearest size that ran it, else as
  PRIOR_SLOPE plain steps per drafted token; widths are explored upwards,
  doubling, so a costly long pass is met once.
* f and a per sequence, from its passes; and, for prompt lookup, from shadow
  drafts while its batch does not draft: the draft lookup would have made is
  compared with the tokens the model then produced (greedy: what a pass would
  have accepted; sampled: a match is as likely as an acceptance), so a batch
  starts drafting when its output begins to repeat, at no cost to plain steps.

Estimates go stale (a cost measured while the machine was busy, a draft
model's acceptance, which has no shadow): a batch that does not draft tries a
pass at the best width already run after FIRST_PAUSE steps, then after twice
as many each time it still does not pay (at most MAX_PAUSE).
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
SAMPLES = 5  # pass costs kept per (batch size, width); one slowed by other work is outvoted
PLAIN_SAMPLES = 9  # plain step times kept per batch size: the yardstick, so more of them
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
    """Step costs per batch size and draft width, in plain steps, and the per-step plan.

    A step's time runs from its start to the next step's start; a step that
    waits for the pending tokens (to draft after them) starts after that wait,
    which is the previous step's computation. A verification pass is over when
    its step returns, so it is recorded before the next step is planned. The
    worker's handling of the tokens a step emitted counts in it (more tokens,
    more handling). An interval across a change of the batch (a request
    joining, leaving, or the worker waiting for one) is not a step's time and
    is dropped.

    A pass's time is kept as a ratio to the plain steps of its batch size just
    before it: on a machine shared with other work both slow down together,
    and a plan made from absolute times would draft exactly when plain steps
    happened to be slow (a decision on noisy estimates picks the noise that
    favours it).
    """

    def __init__(self, max_draft: int) -> None:
        self.max_draft = max_draft
        self._plain: dict[int, deque[float]] = {}  # batch size -> plain step times
        self._ratios: dict[tuple[int, int], deque[float]] = {}  # (size, width) -> pass/plain
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
        if self._open is not None and self._open[2] == uids:
            start, width, _ = self._open
            size = len(uids)
            if width == 0:
                self._plain.setdefault(size, deque(maxlen=PLAIN_SAMPLES)).append(now - start)
            elif size in self._plain:
                ratios = self._ratios.setdefault((size, width), deque(maxlen=SAMPLES))
                ratios.append((now - start) / statistics.median(self._plain[size]))
        self._open = None

    @property
    def drafting(self) -> bool:
        """Whether the open step is a verification pass (it ran to its end: nothing of
        it is left in flight when the next step starts)."""
        return self._open is not None and self._open[1] > 0

    def estimate(self, batch: int, width: int) -> float:
        """A step's cost in plain steps of its batch size, measured or estimated; inf
        for a width not to be tried yet."""
        run = {w: statistics.median(r) for (b, w), r in self._ratios.items() if b == batch}
        floor = max([1.0, *(c for w, c in run.items() if w < width)])
        if width in run:  # never below a shorter pass's: a longer one does its work too
            return max(run[width], floor)
        if width > max(2, 2 * max(run, default=1)):
            return math.inf
        below = sorted(w for w in run if w < width)
        if below:  # the line through the two longest widths below, plain steps as width 0
            w1, w0 = below[-1], below[-2] if len(below) > 1 else 0
            slope = max(PRIOR_SLOPE, (run[w1] - run.get(w0, 1.0)) / (w1 - w0))
            return max(run[w1] + slope * (width - w1), floor)
        others = sorted((abs(b - batch), b) for b, w in self._ratios if w == width)
        if others:  # the nearest batch size's measured cost for this width
            return max(statistics.median(self._ratios[others[0][1], width]), floor)
        return 1.0 + PRIOR_SLOPE * width

    def plan(self, batch: int, candidates: list[tuple[float, float, int]]) -> int:
        """This step's draft width (0: a plain step) for a batch of `batch` sequences, of
        which `candidates` may draft: (found, acceptance, tokens of room after the
        pending one) each."""
        if batch not in self._plain or not candidates:
            return 0  # plain steps first: the yardstick
        run = {w for b, w in self._ratios if b == batch}
        widths = sorted({1, 2, 4, 8, 16, 32, 64, *run})
        best, best_rate = 0, 0.0  # rate: tokens per plain step's time
        retry, retry_rate = 1, 0.0  # the best width run already: what a try re-measures
        for width in (w for w in widths if 0 < w <= self.max_draft):
            cost = self.estimate(batch, width)
            if cost == math.inf:
                break
            gain, none = 0.0, 1.0
            for found, acceptance, room in candidates:
                k = min(width, room)
                gain += found * (expected_tokens(acceptance, k) - 1.0)
                none *= 1.0 - found
            rate = (batch + gain) / ((1.0 - none) * cost + none)
            if rate > best_rate:
                best, best_rate = width, rate
            if width in run and rate > retry_rate:
                retry, retry_rate = width, rate
        if best_rate > MIN_GAIN * batch:
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
