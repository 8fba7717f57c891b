"""Take a batch's KV cache back past each sequence's rejected tokens.

A verification pass writes k+1 keys for every sequence of the batch, and each
sequence keeps its own number of them. mlx-lm's BatchKVCache has one write
position for the whole batch and a left padding per sequence: the
keys every sequence rejected are trimmed (`trim`), and a sequence that
rejected more rolls its extra rejected keys round to the front of its row,
where they become left padding that attention masks out. The rows then read
as if the rejected tokens had never been run: same keys, same offsets (the
tests check the cache equals a non-speculative run's). A rolled row's keys
are copied whole: in a batch whose rows keep different counts a pass costs
that copy too, about as much as the pass's attention reading them (the pass
evaluates it, so the adaptive plan counts it in the pass's cost).

Recurrent layers (ArraysCache: qwen3_next, qwen3_5's Gated DeltaNet conv and
recurrent state) cannot be trimmed: their state is snapshotted before the
pass (`snapshot`: a few small arrays per layer, which mlx never mutates in
place) and, when a sequence rejected a draft, restored; the attention layers
are then trimmed back to the same position and every sequence's kept tokens
run again, right-padded (batch.py). A rotating window may have overwritten
what it would restore: a model with one is not speculated on.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache

from flashserve.engine.speculative.mlx_lm_internals import right_padding_pending, write_position

Snapshot = list[tuple[ArraysCache, tuple[Any, ...]]]


def can_roll_back(cache: list[Any]) -> bool:
    """Whether every layer's cache is a BatchKVCache that holds keys, with no prompt
    padding pending on its right."""
    return bool(cache) and all(
        type(c) is BatchKVCache and c.keys is not None and not right_padding_pending(c)
        for c in cache
    )


def can_snapshot(cache: list[Any]) -> bool:
    """Whether the cache's layers are rollable BatchKVCaches or recurrent ArraysCaches
    (with no prompt lengths pending), at least one of each kind."""
    kv = [c for c in cache if type(c) is BatchKVCache]
    recurrent = [c for c in cache if type(c) is ArraysCache]
    return (
        bool(kv)
        and bool(recurrent)
        and len(kv) + len(recurrent) == len(cache)
        and can_roll_back(kv)
        and all(c.lengths is None for c in recurrent)
    )


def snapshot(cache: list[Any]) -> Snapshot:
    """The recurrent layers' state as it is now (the arrays, not copies: mlx arrays
    are immutable and a layer replaces its entries rather than writing into them)."""
    return [
        (c, (list(c.cache), c.left_padding, c.lengths)) for c in cache if type(c) is ArraysCache
    ]


def restore(saved: Snapshot) -> None:
    """Put the recurrent layers back to a snapshot's state."""
    for c, (arrays, left_padding, lengths) in saved:
        c.cache, c.left_padding, c.lengths = list(arrays), left_padding, lengths


def roll_back(cache: list[BatchKVCache], drop: list[int]) -> None:
    """Remove the newest drop[i] keys of sequence i from every layer."""
    common = min(drop)
    if common:
        for c in cache:
            c.trim(common)
    extra = [d - common for d in drop]
    if not any(extra):
        return
    shifts = mx.array(extra)
    for c in cache:
        end = write_position(c)
        # Only the rows that rejected more are rolled (each copies its keys, up to
        # the write position, so the rejected keys wrap to the front and not into
        # the unused tail), written back into the buffer, which keeps its size
        # (cut to `end`, it would be copied again to grow at the next write).
        for i, shift in enumerate(extra):
            if shift:
                c.keys[i : i + 1, :, :end] = mx.roll(c.keys[i : i + 1, :, :end], shift, axis=2)
                c.values[i : i + 1, :, :end] = mx.roll(c.values[i : i + 1, :, :end], shift, axis=2)
        c.left_padding = c.left_padding + shifts
        c.offset = c.offset - shifts
