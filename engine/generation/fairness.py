"""When a batch's step runs, and when its first tokens come back.

Engines of one process share its cores: a prefill goes first, for a moment.

With several models loaded (engine/models/), each has its own worker, and
their steps run side by side on the same cores. A small model's prompt then
prefills at a fraction of the machine while a big model decodes, and its
first token is late by what the big model's steps take. So while one
engine's batch prefills, another engine's decode step waits for it, bounded
both ways: a step waits at most MAX_WAIT_S, and only during the first
HEAD_START_S of the other's prefill (a long prompt of a big model gets a head
start, not the machine). A prefill never waits, and an engine alone in its
process never does. Tokens are unchanged: only when a step starts moves.

On the CPU, a sequence's first token leaves before the step after it runs
(`first_token_gate`). mlx-lm's GenerationBatch starts each step's successor
before it hands back the step's tokens (`mx.async_eval` of the next tokens,
then an eval of the current ones): on a GPU the two overlap. On the CPU, `async_eval` returns
only once most of the work it was given has run (MLX's scheduler bounds the
tasks in flight), so a step's tokens reach the worker after the following
step has been computed, and a request's first token waits one decode step
longer than it needs to: ~7 ms on the default model, ~30 ms on a 1.2B one,
and under a memory cap a step that streams every layer not resident.

So when the batch's next step emits some sequence's first token, that
step's successor is left lazy (mlx-lm's `async_eval` does nothing for the
step): it runs in the step after, as part of that step's work. The same
arrays are computed in the same order, so tokens are unchanged; only when
a token is handed back moves. Other steps keep mlx-lm's overlap, which on
the CPU still hides the worker's own bookkeeping behind the step's tail.
mlx-lm's generate module sees `mlx.core` through `_StepMx` from the first
gate on: the same functions, with `async_eval` skipped only on the thread
whose step is a first token's (several engines' workers run that module's
code at once).
"""

from __future__ import annotations

import importlib
import threading
import time
from typing import Any

import mlx.core as mx

from flashserve.engine.prompt_cache import background as prompt_background
from flashserve.engine.speculative.mlx_lm_internals import emitted_counts, prompts_pending

# The module: the package `mlx_lm` exports a function of the same name.
_GENERATE = importlib.import_module("mlx_lm.generate")
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
# The prompt cache's disk writer waits while a prompt prefills (prompt_cache/background.py).
prompt_background.set_prefill_probe(lambda: bool(board.prefilling))


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
                    leave()
        # A mark left by a prefill that ended otherwise (a failed step: the batch
        # is replaced) would hold every other engine and the disk writer.
        leave()
        if board.on and board.prefilling:
            _wait_for_others(me)
        return step()

    batch.next = next_step


def leave() -> None:
    """The calling worker is not prefilling (its prefill ended, or its loop did)."""
    me = threading.get_ident()
    if me in board.prefilling:
        with board.cond:
            board.prefilling.pop(me, None)
            board.cond.notify_all()


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


class _StepMx:
    """`mlx.core` as mlx-lm's generate module sees it (see the module's docstring)."""

    def __init__(self) -> None:
        self.local = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)

    def async_eval(self, *arrays: Any) -> None:
        if not getattr(self.local, "lazy", False):
            mx.async_eval(*arrays)


_STEP_MX = _StepMx()


def first_token_due(batch: Any) -> bool:
    """Whether the batch's next step emits some sequence's first token."""
    return 0 in emitted_counts(batch)


def first_token_gate(batch: Any) -> None:
    """Make `batch.next` leave the successor of a first token's step lazy on the CPU."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return
    _GENERATE.mx = _STEP_MX
    step = batch.next

    def next_step() -> Any:
        if not first_token_due(batch):
            return step()
        # A sequence that ends here hands over its cache with the successor's writes
        # still lazy: the worker evaluates what it stores (prompt_states.store_answers).
        _STEP_MX.local.lazy = True
        try:
            return step()
        finally:
            _STEP_MX.local.lazy = False

    batch.next = next_step
