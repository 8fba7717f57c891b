"""A restored state merges into the batch with room for the tokens that follow it.

mlx-lm's BatchGenerator merges each inserted sequence's caches into a
BatchKVCache (`KVCache.merge`), whose buffer is exactly as long as the
longest state. The prompt's first chunk then has nowhere to go, and the
batch cache grows by concatenation: a second copy of the whole cache, on
every prompt-cache hit, inside its TTFT (the 1.2B bench model: 800 tokens,
~150 MB; an agent's 20k-token context: ~4 GB). A cache given `room` here
(the worker: the tokens its prompt still has to prefill) is merged into a
buffer with that room at the end, so the chunk is written in place. Only
where the buffer ends changes: what a sequence attends to, and every number,
are the same.

`KVCache.merge` is mlx-lm's classmethod (it calls `BatchKVCache.merge`);
this module replaces it at import with one that does the same for a cache
without `room`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from flashserve.engine.compute import qmm

_ROOM = "_flashserve_room"


def with_room(cache: list[Any] | None, tokens: int) -> list[Any] | None:
    """`cache` with room for `tokens` more on merge (its plain KV layers)."""
    for layer in cache or ():
        if type(layer) is KVCache:
            setattr(layer, _ROOM, max(0, int(tokens)))
    return cache


def _merge_with_room(_: Any, caches: list[Any]) -> Any:
    room = max((getattr(c, _ROOM, 0) for c in caches), default=0)
    lengths = [int(c.size()) for c in caches]  # (an M-RoPE offset is an int subclass)
    length = max(lengths, default=0)
    if room <= 0 or length == 0:
        return BatchKVCache.merge(caches)
    # mlx-lm's merge (left-padded to the longest state), into a longer buffer.
    filled = [c for c in caches if c.keys is not None]
    heads = max(c.keys.shape[1] for c in filled)
    k_dim = max(c.keys.shape[3] for c in filled)
    v_dim = max(c.values.shape[3] for c in filled)
    dtype = filled[0].keys.dtype
    step = BatchKVCache.step
    # What mlx-lm's growth would make of the exact buffer for `room` tokens, to the
    # position: the batch's KV is the same size either way (memory plans, /memory).
    size = length + (room + step - 1) // step * step
    padding = [length - n for n in lengths]
    ext = qmm.extension() if mx.default_device() == mx.cpu else None
    if ext is not None and len(filled) == len(caches) and _same_heads(filled, heads):
        # On every core (csrc/step_cache.cpp): MLX's zeros and slice_update run on
        # one, bound by faulting in the new buffer's pages (~48 ms of the 1.2B
        # bench model's next turn, ~20 ms this way).
        keys = ext.rows_with_room([c.keys[..., : c.offset, :] for c in caches], padding, size)
        values = ext.rows_with_room([c.values[..., : c.offset, :] for c in caches], padding, size)
    else:
        keys = mx.zeros((len(caches), heads, size, k_dim), dtype=dtype)
        values = mx.zeros((len(caches), heads, size, v_dim), dtype=dtype)
        for i, (pad, c) in enumerate(zip(padding, caches, strict=True)):
            if c.keys is not None:
                keys[i : i + 1, :, pad : pad + c.offset] = c.keys[..., : c.offset, :]
                values[i : i + 1, :, pad : pad + c.offset] = c.values[..., : c.offset, :]
    merged = BatchKVCache(padding)
    merged.keys, merged.values = keys, values
    merged.offset += length
    merged._idx = length  # its write position (speculative/mlx_lm_internals.py checks it)
    return merged


def _same_heads(caches: list[Any], heads: int) -> bool:
    return all(c.keys.shape[1] == heads and c.values.shape[1] == heads for c in caches)


KVCache.merge = classmethod(_merge_with_room)  # type: ignore[method-assign, assignment]
