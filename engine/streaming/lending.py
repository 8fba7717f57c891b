"""Streamed layers resident on loan: the dense plan's room while nothing uses it.

The dense memory plan (denseplan.py) sets aside KV for its whole memory-bound
context, a prefill's working memory and the runtime's, so that any request it
admits fits. Most of the time none is used in full: a decode step holds no
prefill, a conversation shorter than the context holds less KV, and the
runtime's reserve is a margin. That room is lent, never past the memory the
system reports available (less what the plan keeps free for the libraries'
code):

* first to prefetch depth, up to one layer ahead (or the configured depth, if
  less), where the plan gave it up (a layer's read in flight while another
  computes);
* then to streamed layers: one that has just run keeps its weights (no read
  of its own: LayerStreamer `lend_room`), until the loan is full;
* and where the loan and the streaming buffers together hold every streamed
  layer, the buffers too: each last layer stays where it was read, no layer
  streams, and no spare buffer is kept. With as many layers streamed as
  buffers, streaming held their bytes anyway and read them on every token.

The loan is called back before the room is needed: before a request is
admitted (its prefill's working memory, and its prompt's and answer's KV,
restored from the prompt cache or not), and after every decode step by what
the batch's KV will grow to (each sequence's prompt and whole answer, padded
as mlx-lm's batch cache pads them), or a state waits to be written to the
prompt cache's disk tier. A layer given back is streamed again at once and its memory freed
before anything takes the room. Greedy output does not change: where a
layer's weights come from never does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from flashserve.engine.streaming.denseplan import STREAMED_DEPTH

log = logging.getLogger(__name__)

KV_STEP = 256  # tokens mlx-lm's KV cache grows by


@dataclass
class Lending:
    """The loan of one streamer; `settle` is called from the worker thread."""

    streamer: Any  # streaming.streamer.LayerStreamer
    lendable: int  # the plan's KV and prefill reserves
    prefill_bytes: int  # the plan's prefill reserve
    kv_bytes_per_token: int
    planned_depth: int  # the plan's prefetch depth
    max_depth: int  # the configured one
    keep_free: int = 0  # available memory the loan never takes: the plan's kept free
    runtime_bytes: int = 0  # of `lendable`: lent only as far as really free, never to a prefill
    buffer_bytes: int = 0  # the plan's streaming buffers: lent when no layer need stream

    @classmethod
    def for_streamer(cls, streamer: Any, kv_bytes_per_token: int, depth: int) -> Lending | None:
        plan = getattr(streamer, "memory_plan", None)
        if streamer is None or getattr(plan, "context_tokens", None) is None:
            return None  # the dense plan's loan only
        # The runtime's reserve too, but MLX's pool: what the Python heap does not use
        # is free memory, which the worker's check of what is really available
        # (memory_guard.py) lends no further than it goes. The pool's share stays for
        # what a step allocates past the loan's last look (temporaries, a KV cache
        # growing by a step, the freed buffers MLX keeps).
        runtime = max(0, plan.runtime_reserve_bytes - plan.mlx_cache_limit_bytes)
        return cls(
            streamer,
            lendable=plan.kv_reserve_bytes + plan.prefill_reserve_bytes + runtime,
            runtime_bytes=runtime,
            prefill_bytes=plan.prefill_reserve_bytes,
            kv_bytes_per_token=kv_bytes_per_token,
            planned_depth=int(plan.prefetch_depth or 0),
            # No deeper than one layer ahead: a deeper read holds a layer a loan
            # could keep instead (denseplan.STREAMED_DEPTH).
            max_depth=max(min(int(depth), STREAMED_DEPTH), int(plan.prefetch_depth or 0)),
            keep_free=plan.file_reserve_bytes,
            buffer_bytes=plan.stream_buffer_bytes,
        )

    def lent_bytes(self) -> int:
        """Bytes the loan holds now: lent layers and the prefetch depth above the plan's."""
        streamer = self.streamer
        extra = max(0, streamer.prefetch_depth - self.planned_depth) * self._largest()
        return sum(streamer.layer_bytes(i) for i in streamer.lent) + extra

    def _largest(self) -> int:
        streamer = self.streamer
        return max((streamer.layer_bytes(i) for i in range(len(streamer.layers))), default=0)

    def room(self, kv_bytes: int, queued: int, prefill: bool) -> int:
        """What the loan may hold now: the reserves less the batch's KV (`kv_bytes`: the
        most it will grow to, batch_kv_bytes), states queued for disk, and a
        prefill's room if one comes."""
        used = kv_bytes + queued
        return max(0, self.lendable - used - (self.prefill_bytes if prefill else 0))

    def batch_kv_bytes(self, tokens: list[int]) -> int:
        """The most KV a batch of sequences that end at `tokens` (prompt + whole answer)
        holds: mlx-lm's batch cache pads every sequence to the longest, in blocks of
        KV_STEP tokens."""
        if not tokens:
            return 0
        longest = -(-max(tokens) // KV_STEP) * KV_STEP
        return len(tokens) * longest * self.kv_bytes_per_token

    def settle(self, room: int, grow: bool) -> None:
        """Give back what `room` no longer holds; with `grow`, lend the rest (decode)."""
        streamer = self.streamer
        largest = self._largest()
        depth = self.planned_depth
        lent = sum(streamer.layer_bytes(i) for i in streamer.lent)
        streamed = sum(streamer.layer_bytes(i) for i in streamer.streamed_layers)
        if grow and self.buffer_bytes and lent + streamed <= room + self.buffer_bytes:
            room += self.buffer_bytes  # every layer on loan, the buffers' bytes with them
        else:
            while depth < self.max_depth and room >= largest * (depth - self.planned_depth + 1):
                depth += 1
            if not grow:
                depth = self.planned_depth
            room -= (depth - self.planned_depth) * largest
        back = 0
        while lent > room and back < len(streamer.lent):
            back += 1
            lent -= streamer.layer_bytes(streamer.lent[-back])
        if back:
            streamer.give_back(back)
            log.debug("lent layers: %d given back, %d still lent", back, len(streamer.lent))
        streamer.prefetch_depth = depth
        streamer.lend_room = max(0, room - lent) if grow else 0

    def prefill_room(self, room: int) -> int:
        """A prefill's room, given the loan's `room` for it (room(prefill=True)): the
        plan's prefill reserve and the KV room the loan does not hold, not the
        runtime's reserve (a prefill's peak is not checked against what is free)."""
        return max(0, room - self.runtime_bytes - self.lent_bytes()) + self.prefill_bytes

    def prefill_settings(self, room: int, tokens: int) -> tuple[int, bool] | None:
        """(chunk tokens, keep a layer's float copies) for a prefill of prompts reaching
        `tokens` of context, within `room` bytes: the plan's settings, or the
        configured ones (or between) where the room the loan is not using allows.
        The tokens are the same in any chunking. None: nothing to choose from."""
        streamer = self.streamer
        shape, planned = streamer.dense_shape, streamer.planned_prefill
        if shape is None or planned is None or streamer.max_prefill is None:
            return planned
        chunk, keep = planned
        top, may_keep = streamer.max_prefill
        best = (chunk, keep)
        held = tokens * shape.held_bytes_per_token
        size = chunk
        while size <= top:
            for kept in (False, True) if may_keep else (False,):
                copies = shape.float_copy_bytes if kept else shape.float_slice_bytes
                if shape.activations(size, tokens) + copies + held <= room:
                    best = max(best, (size, kept))
            size *= 2
        return best
