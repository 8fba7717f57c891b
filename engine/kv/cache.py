"""Attention KV kept quantized: `kv_bits` 8 or 4, groups of `kv_group_size`.

mlx-lm has a one-sequence quantized cache (QuantizedKVCache) and an attention
that reads it (models/base.py: a cache with `bits` sends attention to
`quantized_scaled_dot_product_attention`, quantized matmuls over the packed
keys and values), but no batched one: its BatchGenerator merges caches
through `merge`, which QuantizedKVCache lacks. Here:

- `QuantizedSeqKVCache` is mlx-lm's QuantizedKVCache plus what batching and
  the prompt cache need (size, merge, an empty nbytes).
- `QuantizedBatchKVCache` holds a batch as three BatchKVCaches, one per
  part of mlx-lm's quantized form (packed integers, scales, biases), keys
  and values in each. mx.quantize works on one (sequence, head, position)
  row at a time, so each part is position-aligned with the tokens and
  mlx-lm's own left padding, filtering, extending and extracting apply to
  it unchanged; no padding or batch neighbour changes a row.

Attention. A decode step on the CPU (the fast path on, at most
compute/step_ops.SDPA_MAX_QUERIES query rows) reads the packed cache as it
is: compute/step_ops.quantized_attention, one op that scores and weighs the
keys and values straight from their integers, scales and biases on every
core (csrc/step_sdpa_quant.cpp). Dequantizing the whole cache each step and
running the float kernel had made decode 0.38x (8 bits) / 0.29x (4 bits) of
a float cache; the times are in docs/guides/kv-cache-quantization.md. Its
numbers differ from the dequantized path's by float32 rounding (sums grouped
differently; the kernel's tests bound it), and like the float kernel
a row's result depends neither on left padding nor on batch neighbours.

Everywhere else (prompt chunks, other devices, the fast path off) `_attention`
dequantizes (mx.dequantize's values; the float copy lives for one layer's
attention) and takes the float path: MLX's CUDA backend lacks the quantized
matmuls a prefill's shapes need, so mlx-lm's quantized SDPA fails there
(docs/guides/cpu-and-gpu.md), and on the CPU MLX's quantized matmuls over a
batch of heads are several times slower than dequantizing and running the
float attention flashserve routes mx.fast.scaled_dot_product_attention to
(compute/step_ops.py, compute/prompt_attention.py). That path gives exactly
the values mlx-lm's would read (MLX's own float SDPA over them matched its
quantized one bit for bit), with the float path's properties: a row's output
depends neither on its chunk nor on left padding, so cached-prefix and
batched greedy tokens match a cold prefill at the same kv_bits. The compiled
decode step (generation/decode_step.py) traces a QuantizedBatchKVCache as its
parts' buffers, so a quantized batch decodes compiled, as a float one does.

Only plain attention layers (a model's KVCache) are quantized; rotating
windows and recurrent state stay as the model makes them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_base
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, _BaseCache

from flashserve.engine.compute import step_ops
from flashserve.engine.kv import BITS, GROUP_SIZES

log = logging.getLogger(__name__)

_PARTS = 3  # packed integers, scales, biases


class _Switch:
    packed = True  # decode attention reads the packed cache (tests, bench: False compares)


_switch = _Switch()


def set_packed_attention(on: bool) -> None:
    """Let decode steps read the packed cache (the default), or dequantize it as before."""
    _switch.packed = on


def packed_attention() -> bool:
    """Whether decode steps may read the packed cache (off: every step dequantizes)."""
    return _switch.packed


class QuantizedSeqKVCache(QuantizedKVCache):
    """One sequence's quantized KV (mlx-lm's), batchable and storable."""

    def size(self) -> int:
        return self.offset

    @classmethod
    def merge(cls, caches: list[QuantizedSeqKVCache]) -> QuantizedBatchKVCache:
        return QuantizedBatchKVCache.merge(caches)

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values))


def _part(cache: QuantizedSeqKVCache, i: int) -> KVCache:
    """Part `i` of a sequence's quantized KV as a float-cache shell (no copy)."""
    shell = KVCache()
    if cache.keys is not None:
        shell.keys, shell.values = cache.keys[i], cache.values[i]
    shell.offset = cache.offset
    return shell


class QuantizedBatchKVCache(_BaseCache):
    """A batch's quantized KV: mlx-lm's BatchKVCache once per quantized part."""

    def __init__(
        self,
        left_padding: list[int],
        group_size: int = 64,
        bits: int = 8,
        parts: list[BatchKVCache] | None = None,
    ) -> None:
        self.group_size, self.bits = group_size, bits
        self.parts = parts or [BatchKVCache(left_padding) for _ in range(_PARTS)]

    # What mlx-lm's batch code and masks read: the same in every part.
    @property
    def offset(self) -> mx.array:
        return self.parts[0].offset

    @property
    def left_padding(self) -> mx.array:
        return self.parts[0].left_padding

    @property
    def _idx(self) -> int:
        return self.parts[0]._idx

    @property
    def keys(self) -> tuple[mx.array, ...] | None:
        return None if self.parts[0].keys is None else tuple(p.keys for p in self.parts)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[tuple, tuple]:
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        out = [p.update_and_fetch(k, v) for p, k, v in zip(self.parts, qk, qv, strict=True)]
        return tuple(k for k, _ in out), tuple(v for _, v in out)

    def keys_and_values(self) -> tuple[tuple, tuple]:
        out = [p.keys_and_values() for p in self.parts]
        return tuple(k for k, _ in out), tuple(v for _, v in out)

    def prepare(self, **kwargs: Any) -> None:
        for p in self.parts:
            p.prepare(**kwargs)

    def finalize(self) -> None:
        for p in self.parts:
            p.finalize()

    @property
    def state(self) -> list[Any]:
        return [p.state for p in self.parts]

    @state.setter
    def state(self, v: list[Any]) -> None:
        for p, s in zip(self.parts, v, strict=True):
            p.state = s

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        trimmed = [p.trim(n) for p in self.parts]
        return trimmed[0]

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.parts[0].make_mask(*args, **kwargs)

    def filter(self, batch_indices: Any) -> None:
        for p in self.parts:
            p.filter(batch_indices)

    def extend(self, other: QuantizedBatchKVCache) -> None:
        for p, o in zip(self.parts, other.parts, strict=True):
            p.extend(o)

    def extract(self, idx: int) -> QuantizedSeqKVCache:
        parts = [p.extract(idx) for p in self.parts]
        cache = QuantizedSeqKVCache(group_size=self.group_size, bits=self.bits)
        cache.keys = tuple(p.keys for p in parts)
        cache.values = tuple(p.values for p in parts)
        cache.offset = parts[0].offset
        return cache

    @classmethod
    def merge(cls, caches: list[QuantizedSeqKVCache]) -> QuantizedBatchKVCache:
        parts = [BatchKVCache.merge([_part(c, i) for c in caches]) for i in range(_PARTS)]
        return cls([], caches[0].group_size, caches[0].bits, parts)

    def size(self) -> int:
        return self.parts[0].size()

    def empty(self) -> bool:
        return self.parts[0].empty()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def _attention(
    queries: mx.array,
    q_keys: tuple[mx.array, mx.array, mx.array],
    q_values: tuple[mx.array, mx.array, mx.array],
    scale: float,
    mask: Any,
    group_size: int = 64,
    bits: int = 8,
) -> mx.array:
    """mlx-lm's quantized SDPA: the packed-cache op for a decode step on the CPU,
    else dequantize + float attention (why: above)."""
    if _switch.packed:
        out = step_ops.quantized_attention(queries, q_keys, q_values, scale, mask, group_size, bits)
        if out is not None:
            return out
    keys = _dequantize(q_keys, group_size, bits)
    values = _dequantize(q_values, group_size, bits)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def _dequantize(parts: tuple[mx.array, mx.array, mx.array], group_size: int, bits: int) -> mx.array:
    """mx.dequantize's values. At 8 bits as a byte view, a cast and one multiply-add,
    which a decode step spends less time in than MLX's CPU dequantize
    (docs/guides/kv-cache-quantization.md); at 4 bits MLX's unpacking is the faster."""
    packed, scales, biases = parts
    if bits != 8:
        return mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits)
    values = packed.view(mx.uint8)  # 4 values per uint32, the first in the lowest byte
    values = values.reshape(*values.shape[:-1], -1, group_size).astype(scales.dtype)
    return (values * scales[..., None] + biases[..., None]).reshape(*packed.shape[:-1], -1)


def head_dims(model: nn.Module) -> set[int]:
    """Attention head sizes of `model`'s layers that state theirs (mlx-lm's modules do)."""
    dims = set()
    for layer in getattr(model, "layers", []):
        attn = getattr(layer, "self_attn", None)
        for name in ("head_dim", "v_head_dim"):
            dim = getattr(attn, name, None)
            if isinstance(dim, int):
                dims.add(dim)
    return dims


def check(bits: int | None, group_size: int) -> None:
    """Raise ValueError naming the setting when `bits` or `group_size` cannot be used."""
    if bits is not None and bits not in BITS:
        raise ValueError(f"kv_bits must be one of {BITS} or unset (a float cache), not {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"kv_group_size must be one of {GROUP_SIZES}, not {group_size}")


def install(model: nn.Module, bits: int | None, group_size: int) -> int:
    """Make `model` hand out quantized attention caches (mlx-lm's make_prompt_cache
    asks `model.make_cache` first); return how many layers' caches are quantized.

    Nothing changes when `bits` is None. Raises ValueError when the setting
    does not fit the model (a group larger than a head, or not dividing it).
    """
    check(bits, group_size)
    if bits is None:
        return 0
    unfit = sorted(d for d in head_dims(model) if d % group_size)
    if unfit:
        raise ValueError(
            f"kv_group_size {group_size} does not divide this model's attention head size "
            f"{unfit[0]}; choose one of {[g for g in GROUP_SIZES if unfit[0] % g == 0] or 'none'}"
            " or leave kv_bits unset"
        )
    # base.scaled_dot_product_attention looks this name up at each call.
    mlx_base.quantized_scaled_dot_product_attention = _attention
    own: Callable[[], list[Any]] | None = getattr(model, "make_cache", None)

    def make_cache() -> list[Any]:
        caches = own() if own is not None else [KVCache() for _ in model.layers]
        return [
            QuantizedSeqKVCache(group_size=group_size, bits=bits) if type(c) is KVCache else c
            for c in caches
        ]

    quantized = sum(isinstance(c, QuantizedSeqKVCache) for c in make_cache())
    model.make_cache = make_cache  # an instance attribute: the model's class is left alone
    log.info(
        "KV cache: %d of %d layers quantized to %d bits (groups of %d)",
        quantized,
        len(make_cache()),
        bits,
        group_size,
    )
    return quantized


def kv_tag(bits: int | None, group_size: int) -> str:
    """What a stored KV state's precision adds to its key: '' for the float cache."""
    return "" if bits is None else f"kv{bits}g{group_size}"
