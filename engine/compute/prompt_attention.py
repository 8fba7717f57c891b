"""Attention for prompt chunks on the CPU: one op on the kernel's threads.

MLX's CPU backend composes mx.fast.scaled_dot_product_attention from
matmuls and a softmax whose exp is scalar: over a long context the softmax
was most of it (issue 42). Its matmuls call the BLAS once per kv head, and
one head's matmul in a short chunk (an agent's next turn: 72 rows x 128
against 792 keys on a 1.2B model) is too small for MKL to spread over the
cores, so a chunk's attention ran on one. The extension's `prompt_sdpa`
(csrc/prompt_sdpa.cpp) computes a kv head's block of query rows against
the keys they may see (scores, the masked softmax, the weighted values) in
one pass, the blocks on every core: 2.9 -> 1.3 ms a layer for that chunk
(docs/benchmarks/agent-turns.md).

A row's numbers do not depend on how many rows or keys its chunk has, so a
prompt gives the same numbers prefilled cold or on top of a cached prefix
(the other chunking).
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
    if not hasattr(ext, "prompt_sdpa"):  # an extension built before this op
        return None
    if isinstance(mask, mx.array):
        if mask.dtype not in (mx.bool_, mx.float32) or mask.ndim > 4:
            return None
        full = (1,) * (4 - mask.ndim) + tuple(mask.shape)
        want = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        if any(size not in (1, w) for size, w in zip(full, want, strict=True)):
            return None
        return ext.prompt_sdpa(q, k, v, [mask], 2 if mask.dtype == mx.bool_ else 3, scale)
    if mask in _MODES:
        return ext.prompt_sdpa(q, k, v, [], _MODES[mask], scale)
    return None
