"""Biases a layer file leaves out because its scales give them exactly.

llama.cpp's symmetric formats (Q4_0, Q8_0, ...) dequantize a block as
d * (q - 2^(b-1)). As MLX's affine quantization that is scale d and bias
-2^(b-1) * d: every bias is its scale times a power of two. Where that rule
gives a tensor's biases bit for bit, prepare (weights/prepare.py) writes no
biases tensor and the manifest names it (`derived`); whoever reads the layer
rebuilds it (`derive_into`) next to the bytes it read. A streamed Q4_0 layer
then reads 4.5 bits per weight, as llama.cpp does, not 5: a tenth less of
every read (issue 54). The biases still sit in memory beside their scales,
so every kernel sees the arrays it saw before, and greedy output is the same.

The rule runs on the floats' bits: the exponent grows by b - 1 and the sign
flips, which is exact for every normal value whose product stays finite;
the rare others (zero, subnormals, values near the top of the range) are
multiplied as floats. prepare checks the result against the biases it would
have written and keeps them where they differ (a bfloat16 outlier, say).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from flashserve.engine.weights.layout import ALIGN, align_up
from flashserve.engine.weights.reader import (
    DIRECT_ALIGN,
    WeightFileError,
    safetensors_entries,
    view_as,
    views_of,
)

# float dtype name -> (unsigned type of its bits, mantissa bits, exponent bits,
# numpy's float type for the odd values, or None where numpy has none)
_FLOATS: dict[str, tuple[Any, int, int, Any]] = {
    "float16": (np.uint16, 10, 5, np.float16),
    "bfloat16": (np.uint16, 7, 8, None),
    "float32": (np.uint32, 23, 8, np.float32),
}


@dataclass(frozen=True)
class Derived:
    """One left-out tensor: `name` = `source` * `times`, at `offset` in the tail."""

    name: str
    source: str
    times: int  # a power of two, negative for the affine biases
    nbytes: int
    offset: int = 0  # from the start of the derived tensors' region (ALIGN steps)


def parse(entries: list[dict] | None) -> tuple[list[Derived], int]:
    """A manifest layer entry's `derived` list: the tensors at their offsets in one
    region after the file's bytes, and the region's size."""
    out, offset = [], 0
    for e in entries or []:
        out.append(Derived(e["name"], e["from"], int(e["times"]), int(e["nbytes"]), offset))
        offset = align_up(offset + int(e["nbytes"]), ALIGN)
    return out, offset


def derive_into(source: np.ndarray, out: np.ndarray, dtype: str, times: int) -> None:
    """`out` (bytes) = `source` (bytes of `dtype` floats) * `times`, exactly."""
    kind, mantissa, exponent_bits, floats = _FLOATS[dtype]
    shift = abs(times).bit_length() - 1
    if abs(times) != 1 << shift:
        raise ValueError(f"times {times} is not a power of two")
    bits, result = source.view(kind), out.view(kind)
    np.add(bits, kind(shift << mantissa), out=result)
    if times < 0:
        np.bitwise_xor(result, kind(1 << (mantissa + exponent_bits)), out=result)
    top = ((1 << exponent_bits) - 1 - shift) << mantissa
    field = bits & kind(((1 << exponent_bits) - 1) << mantissa)
    odd = np.flatnonzero((field == 0) | (field >= top))
    if odd.size:
        if floats is None:
            raise ValueError(f"{dtype}: zero, subnormal or near-overflow scales")
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN stay so
            exact = (bits[odd].view(floats).astype(np.float64) * times).astype(floats)
        result[odd] = exact.view(kind)


def bits_of(a: mx.array) -> np.ndarray:
    """An MLX float array's bytes as numpy (bfloat16 has no numpy type)."""
    view = mx.uint32 if a.dtype == mx.float32 else mx.uint16
    return np.array(a.view(view)).view(np.uint8).reshape(-1)


def derivable(scales: mx.array, biases: mx.array, bits: int) -> int | None:
    """The `times` with biases == scales * times bit for bit (affine, `bits` wide), or
    None."""
    name = _name(scales.dtype)
    if name not in _FLOATS or biases.dtype != scales.dtype or biases.shape != scales.shape:
        return None
    times = -(1 << (bits - 1))
    source, want = bits_of(scales), bits_of(biases)
    got = np.empty_like(source)
    try:
        derive_into(source, got, name, times)
    except ValueError:
        return None
    return times if np.array_equal(got, want) else None


def fill(weights: dict[str, mx.array], entries: list[dict] | None) -> dict[str, mx.array]:
    """`weights` (a layer file's tensors, loaded whole) with its derived tensors added."""
    for d in parse(entries)[0]:
        scales = weights[d.source]
        name = _name(scales.dtype)
        out = np.empty(d.nbytes, np.uint8)
        derive_into(bits_of(scales), out, name, d.times)
        values = mx.array(out.view(_FLOATS[name][0]))  # the floats' bits, as bits_of reads them
        weights[d.name] = values.view(scales.dtype).reshape(scales.shape)
    return weights


def layer_views(
    buffer: mx.array,
    raw: np.ndarray,
    base: int,
    path: Path,
    size: int,
    derived: list[Derived],
    rebuild: bool = True,
) -> dict[str, mx.array]:
    """Every tensor of a layer file (`size` bytes) read whole into `buffer` from byte
    `base`: views of its bytes, and its derived tensors rebuilt after them, from
    the next DIRECT_ALIGN boundary (a direct read may fill the file's last block;
    `tail_bytes` is the room a buffer needs past the file). `rebuild` False: the
    derived tensors are only checked against the file (the caller stands in for
    them: streaming/streamer.py scaled_biases)."""
    entries = safetensors_entries(raw, path, base)
    out = views_of(buffer, raw, entries)
    if not rebuild:
        for d in derived:
            _source_of(d, entries)
        return out
    tail = base + align_up(size, DIRECT_ALIGN)
    return {**out, **views(buffer, raw, entries, tail, derived)}


def tail_bytes(size: int, derived_bytes: int) -> int:
    """The bytes a buffer for a `size`-byte layer file needs past them."""
    return align_up(size, DIRECT_ALIGN) - size + derived_bytes if derived_bytes else 0


def views(
    buffer: mx.array,
    raw: np.ndarray,
    entries: dict[str, tuple[mx.Dtype, int, int, list[int]]],
    tail: int,
    derived: list[Derived],
) -> dict[str, mx.array]:
    """The derived tensors of a layer file read whole into `buffer` (`entries`: its
    tensors, reader.safetensors_entries), rebuilt from byte `tail` of it on."""
    out = {}
    for d in derived:
        dtype, a, b, shape = _source_of(d, entries)
        start = tail + d.offset
        if start + d.nbytes > raw.size:
            raise WeightFileError(f"{d.name}: no room for it after the file's bytes")
        derive_into(raw[a:b], raw[start : start + d.nbytes], _name(dtype), d.times)
        out[d.name] = view_as(buffer, raw, start, start + d.nbytes, dtype, shape)
    return out


def _source_of(
    d: Derived, entries: dict[str, tuple[mx.Dtype, int, int, list[int]]]
) -> tuple[mx.Dtype, int, int, list[int]]:
    if d.source != d.name.removesuffix("biases") + "scales":  # the only kind prepare writes
        raise WeightFileError(f"{d.name}: its source {d.source} is not its scales")
    dtype, a, b, shape = entries.get(d.source, (None, 0, -1, []))
    if b - a != d.nbytes:
        raise WeightFileError(f"{d.name}: its source {d.source} is not in the file as listed")
    return dtype, a, b, shape


def _name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")
