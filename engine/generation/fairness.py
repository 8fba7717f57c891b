"""Engines of one process share its cores: a prefill goes first, for a moment.

With several models loaded (engine/models/), each has its own worker, and
their steps run side by side on the same cores. A small model's prompt then
prefills at a fraction of the machine while a big model decodes, and its
first token is late by what the big model's steps take. So while one
engine's batch prefills, another engine's decode step waits for it, bounded
both ways: a step waits at most MAX_WAIT_S, and only during the first
HEAD_START_S of the other's prefill (a long prompt of a big model gets a head
start, not the machine). A prefill never waits, and an engine alone in its
process never does. Tokens are unchanged: only when a step starts moves.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from flashserve.engine.speculative.mlx_lm_internals import prompts_pending

HEAD_START_S = 1.0
MAX_WAIT_S = 1.0


class _Board:
    """Which workers are prefilling, since when (one per process)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.prefilling: dict[int, float] = {}  # worker thread -> start of its prefill
        self.waited_s = 0.0  # decode steps' time spent waiting, all engines (tests, bench)
        self.on = True


board = _Board()


def gate(batch: Any) -> None:
    """Make `batch.next` (mlx-lm's BatchGenerator step) take its turn as above."""
    step = batch.next

    def next_step() -> Any:
        me = threading.get_ident()
        if board.on and prompts_pending(batch):
            with board.cond:
                board.prefilling.setdefault(me, time.monotonic())
            try:
                return step()
            finally:
                if not prompts_pending(batch):
                    with board.cond:
                        board.prefilling.pop(me, None)
                        board.cond.notify_all()
        if board.on and board.prefilling:
            _wait_for_others(me)
        return step()

    batch.next = next_step


def _wait_for_others(me: int) -> None:
    start = time.monotonic()
    with board.cond:
        while True:
            now = time.monotonic()
            ends = [t + HEAD_START_S for w, t in board.prefilling.items() if w != me]
            ends = [end for end in ends if end > now]
            if not ends or now - start >= MAX_WAIT_S:
                break
            board.cond.wait(min(min(ends), start + MAX_WAIT_S) - now)
        board.waited_s += time.monotonic() - start
