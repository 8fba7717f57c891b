"""Attention for prompt chunks on the CPU: BLAS matmuls around flashserve's softmax.

MLX's CPU backend composes mx.fast.scaled_dot_product_attention from
matmuls (the BLAS: fast) and a softmax whose exp is scalar. Over a long
context the softmax is most of it: 200 new tokens against 4,200 keys took
125 ms a layer, 92 of them in the softmax (issue 42), so a prompt prefilled
on top of a long cached prefix ran at a few times what its arithmetic
says. Here the same matmuls run through MLX (the BLAS), and the mask and
softmax are one vectorized op spread over the kernel's threads
(csrc/prompt_softmax.cpp).

Query heads are grouped under their key/value head (GQA) as MLX's
fallback groups them, so k and v are never repeated. A row's weights do not
depend on how many keys its chunk has, so a prompt gives the same numbers
prefilled cold or on top of a cached prefix (the other chunking).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

_MODES = {None: 0, "causal": 1}  # array masks: 2 (bool), 3 (additive float32)


def attention(
    ext: Any, q: mx.array, k: mx.array, v: mx.array, scale: float, mask: str | mx.array | None
) -> mx.array | None:
    """softmax(scale * q k^T + mask) v for (B, H, L, D) float32 q, k, v; None when
    the mask is of a kind this does not take (MLX's fallback then runs)."""
    if not hasattr(ext, "masked_softmax"):  # an extension built before this op
        return None
    batch, heads, rows, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    repeats = heads // kv_heads
    masks: list[mx.array] = []
    if isinstance(mask, mx.array):
        if mask.dtype not in (mx.bool_, mx.float32) or mask.ndim > 4:
            return None
        full = (1,) * (4 - mask.ndim) + tuple(mask.shape)
        if full[1] not in (1, heads) or full[2] not in (1, rows) or full[3] not in (1, keys):
            return None
        # (B, H, L, K) as (B, Hk, repeats, L, K): a reshape of the head axis,
        # or a new axis where the mask is the same for every head.
        if full[1] == heads:
            m = mask.reshape(full[0], kv_heads, repeats, full[2], full[3])
        else:
            m = mask.reshape(full[0], 1, 1, full[2], full[3])
        masks, mode = [m], 2 if mask.dtype == mx.bool_ else 3
    elif mask in _MODES:
        mode = _MODES[mask]
    else:
        return None
    # As MLX's fallback: q scaled first, heads grouped by kv head.
    grouped = (q * scale).reshape(batch, kv_heads, repeats * rows, dim)
    scores = grouped @ k.swapaxes(-1, -2)
    weights = ext.masked_softmax(scores.reshape(batch, kv_heads, repeats, rows, keys), masks, mode)
    out = weights.reshape(batch, kv_heads, repeats * rows, keys) @ v
    return out.reshape(batch, heads, rows, v.shape[-1])
