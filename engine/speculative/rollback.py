"""Take a batch's KV cache back past each sequence's rejected tokens.

A verification pass writes k+1 keys for every sequence of the batch, and each
sequence keeps its own number of them. mlx-lm's BatchKVCache has one write
position for the whole batch (`_idx`) and a left padding per sequence: the
keys every sequence rejected are trimmed (`trim`), and a sequence that
rejected more rolls its extra rejected keys round to the front of its row,
where they become left padding that attention masks out. The rows then read
as if the rejected tokens had never been run: same keys, same offsets (the
tests check the cache equals a non-speculative run's).

Only BatchKVCache layers are taken back: recurrent state (ArraysCache,
MambaCache: qwen3_next, qwen3_5 layers) cannot be trimmed and a rotating
window may have overwritten what it would restore, so a model with such
layers is not speculated on (`can_roll_back`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, dynamic_roll


def can_roll_back(cache: list[Any]) -> bool:
    """Whether every layer's cache is a BatchKVCache that holds keys, with no prompt
    padding pending on its right."""
    return bool(cache) and all(
        type(c) is BatchKVCache and c.keys is not None and c._right_padding is None for c in cache
    )


def roll_back(cache: list[BatchKVCache], drop: list[int]) -> None:
    """Remove the newest drop[i] keys of sequence i from every layer."""
    common = min(drop)
    if common:
        for c in cache:
            c.trim(common)
    extra = [d - common for d in drop]
    if not any(extra):
        return
    shifts = mx.array(extra)[:, None]
    for c in cache:
        end = c._idx
        # The buffer cut at the write position, so the roll wraps the rejected
        # keys to the front and not into the unused tail.
        c.keys = dynamic_roll(c.keys[..., :end, :], shifts, axis=2)
        c.values = dynamic_roll(c.values[..., :end, :], shifts, axis=2)
        c.left_padding = c.left_padding + shifts[:, 0]
        c.offset = c.offset - shifts[:, 0]
