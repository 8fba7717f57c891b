"""Attention KV split by token position, and joined back: the disk tier's segments.

An agent resends the whole conversation every turn, so each stored state is a
long prefix already on disk plus a few hundred new tokens. A state whose every
layer is a plain KVCache (keys and values shaped batch, heads, positions, dim),
or its quantized form (kv_bits: three such arrays each, packed integers,
scales and biases, all by position), is written as a segment: the positions
past the longest prefix already on disk, with a link to the segment it
continues. Restoring a state joins its chain of segments, root first, along
the positions axis.

Anything else (recurrent state: ArraysCache; rotating KV) cannot
be cut by position and is written whole, as one segment with no parent.

`slice_views` runs on the disk writer thread: numpy over byte views, no MLX.
`join` runs on the worker thread.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from flashserve.engine.kv.cache import QuantizedSeqKVCache

_AXIS = 2  # positions, in the (batch, heads, positions, dim) of KVCache's keys and values
_BY_POSITION = (KVCache, QuantizedSeqKVCache)


def splittable(tokens: list[int], cache: list[Any]) -> bool:
    """Whether `cache` can be cut by position: plain KV of exactly `tokens`, float or
    quantized (kv_bits: packed integers, scales and biases, each by position)."""
    return bool(cache) and all(
        type(c) in _BY_POSITION
        and c.keys is not None
        and all(a.ndim == 4 for a in _arrays(c))
        and c.offset == len(tokens)
        for c in cache
    )


def _arrays(c: Any) -> list[mx.array]:
    """A position-cut cache's arrays: keys and values, or each one's quantized parts."""
    if type(c) is KVCache:
        return [c.keys, c.values]
    return [*c.keys, *c.values]


def slice_views(
    arrays: list[tuple[str, list[int], memoryview]], start: int, end: int
) -> list[tuple[str, list[int], memoryview]]:
    """Positions [start, end) of each KV array, given as raw bytes of its whole buffer.

    The buffer can hold more positions than the state (KVCache grows in steps);
    only the state's own positions are kept.
    """
    out = []
    for dtype, shape, view in arrays:
        batch, heads, capacity, dim = shape
        if not 0 <= start <= end <= capacity:
            raise ValueError(f"positions {start}:{end} outside a buffer of {capacity}")
        raw = np.frombuffer(view, dtype=np.uint8)
        row = view.nbytes // (batch * heads * capacity)  # bytes of one position's dim
        part = np.ascontiguousarray(raw.reshape(batch * heads, capacity, row)[:, start:end])
        out.append((dtype, [batch, heads, end - start, dim], memoryview(part).cast("B")))
    return out


def sliced_nbytes(arrays: list[tuple[str, list[int], memoryview]], start: int, end: int) -> int:
    """Bytes `slice_views(arrays, start, end)` would hold."""
    return sum(view.nbytes // shape[_AXIS] * (end - start) for _, shape, view in arrays)


def join(caches: list[list[Any]], lengths: list[int]) -> list[Any]:
    """One KV state from the segments' states, root first, each cut to its length.

    Every segment holds the same layers; a segment's length is how many of its
    positions the chain uses (its child may continue from part way through it).
    """
    if len(caches) == 1 and caches[0] and type(caches[0][0]) not in _BY_POSITION:
        return caches[0]  # written whole
    joined = []
    for layer in zip(*caches, strict=True):
        parts = [[a[:, :, :n] for a in _arrays(c)] for c, n in zip(layer, lengths, strict=True)]
        arrays = [
            mx.concatenate(a, axis=_AXIS) if len(a) > 1 else a[0] for a in zip(*parts, strict=True)
        ]
        if type(layer[0]) is KVCache:
            cache = KVCache()
            cache.keys, cache.values = arrays
        else:  # kv_bits: the same precision in every segment (it is in the fingerprint)
            cache = QuantizedSeqKVCache(layer[0].group_size, layer[0].bits)
            half = len(arrays) // 2
            cache.keys, cache.values = tuple(arrays[:half]), tuple(arrays[half:])
        cache.offset = int(arrays[0].shape[_AXIS])
        joined.append(cache)
    return joined
