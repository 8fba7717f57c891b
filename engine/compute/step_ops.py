"""A decode step's small ops on the CPU: RMSNorm, RoPE, attention, SwiGLU, log-sum-exp.

MLX's CPU backend has no kernel for mx.fast.rms_norm, mx.fast.rope or
mx.fast.scaled_dot_product_attention: each is built from its composed
fallback (15, 31 and 18 graph nodes). A decode step of the default model had
3,380 nodes, and on the CPU each node costs microseconds of graph walking,
allocation and hand-off to MLX's stream thread whatever its size: with the
quantized matmuls fast (compute/qmm.py), these nodes were most of a
one-stream step (issue 22). The extension (csrc/step_ops.cpp) computes each
in one pass, one node. Two are one node already but scalar: mx.logsumexp
(0.9 ms per row over the default model's 49k vocabulary, which mlx-lm's
sampler normalizes every step), and mlx-lm's compiled `swiglu` (MLX's
compiled CPU kernels call a scalar exp per element); the extension's are
vectorized.

Where their results feed one another, the ops read through the views
between them and compute the next op's input themselves (csrc/graph_folds.h):
RoPE reads q and k as projected, the output projection reads attention's
heads, a quantized matmul computes the RMSNorm or SwiGLU it is fed, and
`cache_write` stores keys or values read through the views (the compiled
decode step's cache). Each is a graph node less, with the same numbers.

`install()` routes the three mx.fast functions and mx.logsumexp through this
module, and replaces `swiglu` in mlx-lm's model modules (each imports its
own name for it), so every architecture's and sampler's call sites take
them unchanged. A call takes the fast op when the fast path is on (the
`quantized_matmul` setting: one switch for flashserve's CPU path), its
arrays are float32 on the default CPU stream and, for attention, there are
at most `SDPA_MAX_QUERIES` query rows (decode; prompt chunks, and any
call inside prompt_matmul.prompt_rows, take compute/prompt_attention.py) and
no attention sinks;
log-sum-exp must reduce the last axis. Anything else goes to MLX's function.
Results agree with MLX's to float32 rounding; every path of a request
(resident, streamed, cached, batched) takes the same op, so they still agree
with each other exactly.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import mlx.core as mx
from mlx_lm.models import activations

from flashserve.engine.compute import prompt_attention, prompt_matmul, qmm

SDPA_MAX_QUERIES = 8  # query rows per head up to which attention takes the fast op

_MASK_MODES = {None: 0, "causal": 1}  # array masks: 2 (bool), 3 (additive float32)


class _State:
    enabled = True  # the bench and tests turn it off to compare with MLX's ops
    original: ClassVar[dict[str, Callable[..., mx.array]]] = {}  # MLX's functions, once installed


_state = _State()


def install() -> None:
    """Route the step ops' call sites here: mx.fast's three, mx.logsumexp, mlx-lm's `swiglu`.

    mx's functions are replaced once. An mlx-lm model module binds `swiglu`
    when it is imported, so each call also points the model modules loaded
    since at ours (the loader calls this after loading the model).
    """
    if not _state.original:
        for module, name, fn in (
            (mx.fast, "rms_norm", rms_norm),
            (mx.fast, "rope", rope),
            (mx.fast, "scaled_dot_product_attention", scaled_dot_product_attention),
            (mx, "logsumexp", logsumexp),
        ):
            _state.original[name] = getattr(module, name)
            setattr(module, name, fn)
        _state.original["swiglu"] = activations.swiglu
    for name, module in list(sys.modules.items()):
        if (
            name.startswith("mlx_lm.models.")
            and module.__dict__.get("swiglu") is (_state.original["swiglu"])
        ):
            module.swiglu = swiglu


def set_enabled(on: bool) -> None:
    """Allow or forbid the step ops while the fast path is on (tests compare with MLX's)."""
    _state.enabled = on


def active() -> bool:
    """Whether calls take the fast ops now (the fast path is on and they are allowed)."""
    return _fast() is not None


def _fast() -> Any | None:
    """The extension when calls may take the fast ops now, else None."""
    if not (_state.enabled and qmm.active()):
        return None
    return qmm.extension()


def _original(name: str) -> Callable[..., mx.array]:
    """MLX's (or mlx-lm's) function that `name` replaced (install() has run: it is the way in)."""
    return _state.original[name]


def rms_norm(x: mx.array, weight: mx.array | None, eps: float, *, stream: Any = None) -> mx.array:
    """mx.fast.rms_norm, as one op on the CPU for float32 (with or without a weight)."""
    ext = _fast()
    if (
        ext is not None
        and stream is None
        and x.dtype == mx.float32
        and x.ndim >= 1
        and (
            weight is None
            or (weight.dtype == mx.float32 and weight.ndim == 1 and weight.shape[0] == x.shape[-1])
        )
    ):
        return ext.rms_norm(x, [] if weight is None else [weight], eps)
    return _original("rms_norm")(x, weight, eps, stream=stream)


def rope(
    a: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None = None,
    stream: Any = None,
) -> mx.array:
    """mx.fast.rope, as one op on the CPU for float32 (3-D or 4-D input)."""
    ext = _fast()
    if (
        ext is not None
        and stream is None
        and a.dtype == mx.float32
        and a.ndim in (3, 4)
        and (base is None) != (freqs is None)
        and 0 < dims <= a.shape[-1]
        and dims % 2 == 0
    ):
        if isinstance(offset, mx.array):
            off = offset if offset.dtype == mx.int32 else offset.astype(mx.int32)
        else:
            off = mx.array(offset, dtype=mx.int32)
        if off.ndim <= 1 and off.size in (1, a.shape[0]):
            fs = (
                []
                if freqs is None
                else [freqs if freqs.dtype == mx.float32 else freqs.astype(mx.float32)]
            )
            b = 1.0 if base is None else float(base)
            return ext.rope(a, off, fs, dims, traditional, b, float(scale))
    return _original("rope")(
        a,
        dims,
        traditional=traditional,
        base=base,
        scale=scale,
        offset=offset,
        freqs=freqs,
        stream=stream,
    )


def scaled_dot_product_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: str | mx.array | None = None,
    sinks: mx.array | None = None,
    stream: Any = None,
) -> mx.array:
    """mx.fast.scaled_dot_product_attention on the CPU for float32: one op for few
    query rows (decode), the prompt attention op for more (prompt chunks)."""
    ext = _fast()
    if (
        ext is not None
        and stream is None
        and sinks is None
        and q.ndim == k.ndim == v.ndim == 4
        and q.dtype == k.dtype == v.dtype == mx.float32
        and q.shape[1] % k.shape[1] == 0
    ):
        if q.shape[2] > SDPA_MAX_QUERIES or prompt_matmul.all_prompt_rows():
            out = prompt_attention.attention(ext, q, k, v, scale, mask)
            if out is not None:
                return out
        elif isinstance(mask, mx.array):
            if mask.dtype == mx.bool_:
                return ext.sdpa(q, k, v, [mask], 2, scale)
            if mask.dtype == mx.float32:
                return ext.sdpa(q, k, v, [mask], 3, scale)
        elif mask in _MASK_MODES:
            return ext.sdpa(q, k, v, [], _MASK_MODES[mask], scale)
    return _original("scaled_dot_product_attention")(
        q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream
    )


def quantized_attention(
    q: mx.array,
    keys: Sequence[mx.array],
    values: Sequence[mx.array],
    scale: float,
    mask: str | mx.array | None,
    group_size: int,
    bits: int,
) -> mx.array | None:
    """Decode attention over kv_bits' cache as one CPU op, or None where it does not apply.

    `keys` and `values` are MLX-quantized (packed uint32, float32 scales,
    biases), as kv/cache.py keeps them; the op reads them packed
    (csrc/step_sdpa_quant.cpp). None (the caller dequantizes) for prompt
    chunks (more than SDPA_MAX_QUERIES query rows, or any inside
    prompt_matmul.prompt_rows), other dtypes, an
    extension built without the op, or while the fast ops are off.
    """
    ext = _fast()
    if (
        ext is None
        or not hasattr(ext, "sdpa_quant")
        or q.dtype != mx.float32
        or q.ndim != 4
        or q.shape[2] > SDPA_MAX_QUERIES
        or prompt_matmul.all_prompt_rows()
        or len(keys) != 3
        or len(values) != 3
        or any(a.dtype != mx.float32 for a in (*keys[1:], *values[1:]))
        or keys[0].dtype != mx.uint32
        or values[0].dtype != mx.uint32
    ):
        return None
    if isinstance(mask, mx.array):
        if mask.dtype not in (mx.bool_, mx.float32):
            return None
        mode, masks = (2 if mask.dtype == mx.bool_ else 3), [mask]
    elif mask in _MASK_MODES:
        mode, masks = _MASK_MODES[mask], []
    else:
        return None
    return ext.sdpa_quant(q, list(keys), list(values), masks, mode, scale, group_size, bits)


def logsumexp(
    a: mx.array,
    /,
    axis: int | Sequence[int] | None = None,
    keepdims: bool = False,
    *,
    stream: Any = None,
) -> mx.array:
    """mx.logsumexp, vectorized on the CPU for float32 over the last axis."""
    ext = _fast()
    if ext is not None and stream is None and a.dtype == mx.float32 and a.ndim >= 1:
        last = axis[0] if isinstance(axis, Sequence) and len(axis) == 1 else axis
        if last in (-1, a.ndim - 1) or (last is None and a.ndim == 1):
            return ext.logsumexp(a, keepdims)
    return _original("logsumexp")(a, axis=axis, keepdims=keepdims, stream=stream)


def cache_write(buffer: mx.array, x: mx.array, at: mx.array) -> mx.array:
    """`buffer` with x (B, H, T, D) written at position `at` (int32, shape (1,)) of axis 2.

    One op that reads x through the views splitting it into heads, in place
    where the buffer can be donated (csrc/step_cache.cpp); `mx.slice_update`
    where the fast ops do not run.
    """
    ext = _fast()
    if ext is not None and buffer.dtype == x.dtype == mx.float32 and buffer.ndim == x.ndim == 4:
        return ext.cache_write(buffer, x, at)
    return mx.slice_update(buffer, x, at, axes=(2,))


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's swiglu (silu(gate) * x), vectorized on the CPU for float32."""
    ext = _fast()
    if ext is not None and gate.dtype == x.dtype == mx.float32 and gate.shape == x.shape:
        return ext.swiglu(gate, x)
    return _original("swiglu")(gate, x)
