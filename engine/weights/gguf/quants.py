"""ggml blocks -> MLX affine quantization (group size 32), in numpy, never through float16.

MLX affine quantization stores `w = scale * q + bias` for each group of 32
weights, q unsigned and packed little-endian into uint32 words (element i of a
row at bit `bits * i` of the row's bit stream). Each ggml type maps as follows:

- Q4_0, Q5_0, Q8_0: `w = d * (q - 2^(bits-1))`, so scale = d, bias = -2^(bits-1) d;
  Q4_1, Q5_1: `w = d * q + m`. Exact, and exact in float16 too (d and m are
  float16 in the file, and a power-of-two multiple of d is exact): their
  scales stay float16, the file's own precision, whatever the compute dtype.
- Q4_K, Q5_K: eight 32-weight sub-blocks `w = d sc q - dmin m`: scale = d sc,
  bias = -dmin m. Exact in float32 (d sc is an 11-bit by 6-bit product), so
  their scales take the compute dtype (float32 on the CPU).
- Q3_K: sixteen 16-weight sub-blocks `w = d sc q`, sc in [-32, 31] and q in
  [-4, 3], so `sc q + 124` fits 8 bits: exact as 8-bit with scale d and
  bias -124 d, in float32.
- Q6_K, Q2_K: 16-weight sub-blocks whose scales (and Q2_K's minimums) differ
  within a group of 32, which no MLX form holds exactly: the exact values are
  re-quantized to 8 bits per group of 32 (float16 scales, rounded so that the
  error stays within half a step: |error| <= scale / 2 = group range / 510).
- F32, F16, BF16: float arrays (the caller casts them to the compute dtype).

Every other type (IQ*, TQ*, MXFP4, I8...) is refused naming the tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from flashserve.engine.weights.gguf.container import GGML_TYPES, GGUFError, TensorInfo

GROUP = 32
_CHUNK_ELEMENTS = 1 << 23  # rows converted at a time: bounds the temporaries

FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}
EXACT_HALF = {2, 3, 6, 7, 8}  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0: exact with float16 scales
EXACT = {11, 12, 13}  # Q3_K Q4_K Q5_K: exact with float32 scales
REQUANTIZED = {10, 14}  # Q2_K Q6_K: re-quantized to 8 bits, group 32
SUPPORTED = set(FLOAT_TYPES) | EXACT_HALF | EXACT | REQUANTIZED


@dataclass
class Quantized:
    """An MLX affine-quantized tensor: packed weight, scales and biases (numpy)."""

    weight: np.ndarray  # uint32, (..., cols * bits / 32)
    scales: np.ndarray  # (..., cols / 32)
    biases: np.ndarray
    bits: int
    exact: bool

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes + self.biases.nbytes


def supported_names() -> str:
    return ", ".join(GGML_TYPES[k][0] for k in sorted(SUPPORTED))


def check_supported(info: TensorInfo) -> None:
    if info.kind not in SUPPORTED:
        raise GGUFError(
            f"tensor {info.name} has type {info.type_name}, which is not supported "
            f"(supported: {supported_names()})"
        )


# --------------------------------------------------------------------------- packing


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 values (rows, cols) -> MLX's packed uint32 words (rows, cols * bits / 32)."""
    rows, cols = q.shape
    if bits in (2, 4, 8):  # whole values per byte, lowest bits first
        per = 8 // bits
        packed = q[:, ::per].copy()
        for k in range(1, per):
            packed |= q[:, k::per] << np.uint8(bits * k)
        return packed.view("<u4")
    # 3, 5, 6 bits: eight values fill exactly `bits` bytes; build them in a uint64
    words = q[:, ::8].astype(np.uint64)
    for k in range(1, 8):
        words |= q[:, k::8].astype(np.uint64) << np.uint64(bits * k)
    data = words.astype("<u8", copy=False).view(np.uint8).reshape(rows, cols // 8, 8)[..., :bits]
    return np.ascontiguousarray(data).reshape(rows, cols * bits // 8).view("<u4")


# --------------------------------------------------------------------------- block decoders
# Each takes blocks (n, bytes per block) and returns q (n, elements) uint8 and
# per-group scale and bias (n, elements / 32) float32, or exact float values.


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, start : start + 2]).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # 32-weight ggml blocks: element j in the low nibble of byte j, j + 16 in its high one
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    # Q5_0/Q5_1: bit j of a little-endian uint32 is element j's fifth bit
    return np.unpackbits(qh, axis=-1, bitorder="little") << 4


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:18]), d, -8 * d


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    return _nibbles(b[:, 6:22]) | _high_bits(b[:, 2:6]), d, -16 * d


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(b[:, 8:24]) | _high_bits(b[:, 4:8]), _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    return b[:, 2:34] ^ np.uint8(0x80), d, -128 * d  # int8 q -> q + 128


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # Q4_K/Q5_K: eight 6-bit scales and eight 6-bit minimums in 12 bytes
    s = packed.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_low(qs: np.ndarray) -> np.ndarray:
    # Q4_K/Q5_K: 64-weight chunks of 32 bytes; low nibbles first, then high nibbles
    chunks = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(-1, 256)


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    return _k_low(b[:, 16:144]), d * sc, -(dmin * mn)


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    # bit j of byte l is the fifth bit of sub-block j's element l
    high = np.unpackbits(b[:, 16:48, None], axis=-1, bitorder="little").transpose(0, 2, 1)
    return _k_low(b[:, 48:176]) | (high.reshape(-1, 256) << 4), d * sc, -(dmin * mn)


def _q3_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = len(b)
    hmask, qs, packed, d = b[:, 0:32], b[:, 32:96], b[:, 96:108], _f16(b, 108)
    low = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)) & 0x0F
    high = (packed[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)) & 3
    sc = (low.reshape(n, 16) | (high.reshape(n, 16) << 4)).astype(np.int16) - 32
    ql = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    qh = np.unpackbits(hmask[:, :, None], axis=-1, bitorder="little").transpose(0, 2, 1)
    # the high bit *clear* subtracts 4: q in [-4, 3]
    q = ql.reshape(n, 16, 16).astype(np.int16) - ((qh.reshape(n, 16, 16) ^ 1) << 2)
    # sc * q lies in [-124, 128]: shifted by 124 it is an 8-bit value
    d = np.repeat(d, 8, axis=1)  # one scale for the 8 groups of 32
    return (sc[:, :, None] * q + 124).astype(np.uint8).reshape(n, 256), d, -124 * d


def _q6_k(b: np.ndarray) -> np.ndarray:
    n = len(b)
    ql = (b[:, 0:128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    qh = (
        b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    ) & 3
    q = (ql.reshape(n, 8, 32) | (qh.reshape(n, 8, 32) << 4)).astype(np.float32) - 32
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return (_f16(b, 208) * sc)[:, :, None] * q.reshape(n, 16, 16)


def _q2_k(b: np.ndarray) -> np.ndarray:
    n = len(b)
    packed, qs, d, dmin = b[:, 0:16], b[:, 16:80], _f16(b, 80), _f16(b, 82)
    scale = d * (packed & 0x0F).astype(np.float32)
    minimum = dmin * (packed >> 4).astype(np.float32)
    q = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    return scale[:, :, None] * q.reshape(n, 16, 16).astype(np.float32) - minimum[:, :, None]


# kind -> (bits, decoder); decoders of REQUANTIZED types return exact float values
_DECODERS: dict[int, tuple[int, Callable]] = {
    2: (4, _q4_0),
    3: (4, _q4_1),
    6: (5, _q5_0),
    7: (5, _q5_1),
    8: (8, _q8_0),
    11: (8, _q3_k),
    12: (4, _q4_k),
    13: (5, _q5_k),
    10: (8, _q2_k),
    14: (8, _q6_k),
}


# --------------------------------------------------------------------------- re-quantization


def _round_half(x: np.ndarray, up: bool) -> np.ndarray:
    """float32 -> the nearest float16 on one side (up: >= x, else <= x)."""
    h = x.astype(np.float16)
    wrong = h.astype(np.float32) < x if up else h.astype(np.float32) > x
    return np.where(wrong, np.nextafter(h, np.float16(np.inf if up else -np.inf)), h)


def requantize(values: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact values (groups, 32) -> 8-bit q, scale, bias in `dtype`; |error| <= scale / 2.

    The bias is rounded down and the scale up to `dtype` before q is chosen, so
    q is computed against the stored values and no value falls outside the range.
    """
    lo, hi = values.min(axis=1), values.max(axis=1)
    if dtype == np.float16:
        bias = _round_half(lo, up=False)
        scale = _round_half((hi - bias.astype(np.float32)) / 255, up=True)
        if not (np.isfinite(bias).all() and np.isfinite(scale).all()):
            return requantize(values, np.float32)  # past float16's range
    else:
        bias, scale = lo.astype(dtype), ((hi - lo) / 255).astype(dtype)
    b32, s32 = bias.astype(np.float32), scale.astype(np.float32)
    safe = np.where(s32 > 0, s32, 1)
    q = np.rint((values - b32[:, None]) / safe[:, None]).clip(0, 255).astype(np.uint8)
    return q, scale, bias


# --------------------------------------------------------------------------- tensors


def _floats(kind: int, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if kind == 0:
        return raw.view("<f4").reshape(shape)
    if kind == 1:
        return raw.view("<f2").reshape(shape)
    # BF16: the high half of a float32
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)


def convert(info: TensorInfo, raw: np.ndarray, compute: np.dtype) -> np.ndarray | Quantized:
    """One GGUF tensor -> a float array or an MLX-quantized one.

    `compute` is the compute dtype (float32 or float16): the scale dtype of the
    types that are exact only in float32 (K-quants); on float16 compute they
    are rounded like every other float.
    """
    check_supported(info)
    if info.kind in FLOAT_TYPES:
        return _floats(info.kind, raw, info.shape)
    _, block, block_bytes = GGML_TYPES[info.kind]
    bits, decode = _DECODERS[info.kind]
    cols = info.shape[-1]
    rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
    # Exact types keep float16 scales where float16 holds them exactly (legacy types),
    # the compute dtype where only float32 does (K-quants); re-quantized types use
    # float16, the rounding included in their bound.
    scale_dtype = compute if info.kind in EXACT else np.float16
    blocks = raw.reshape(-1, block_bytes)
    per_row = cols // block
    weight = np.empty((rows, cols * bits // 32), np.uint32)
    scales = np.empty((rows, cols // GROUP), np.float32)
    biases = np.empty((rows, cols // GROUP), np.float32)
    step = max(1, _CHUNK_ELEMENTS // cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        out = decode(np.asarray(blocks[r0 * per_row : r1 * per_row]))
        q, s, b = (
            requantize(out.reshape(-1, GROUP), scale_dtype) if info.kind in REQUANTIZED else out
        )
        weight[r0:r1] = pack(q.reshape(r1 - r0, cols), bits)
        scales[r0:r1] = s.reshape(r1 - r0, -1)
        biases[r0:r1] = b.reshape(r1 - r0, -1)
    lead = info.shape[:-1]
    if scale_dtype == np.float16:
        with np.errstate(over="ignore"):
            half = np.isfinite(scales.astype(np.float16)) & np.isfinite(biases.astype(np.float16))
        if not half.all():
            scale_dtype = np.float32  # past float16's range: kept as computed
    return Quantized(
        weight=weight.reshape(*lead, -1),
        scales=scales.astype(scale_dtype).reshape(*lead, -1),
        biases=biases.astype(scale_dtype).reshape(*lead, -1),
        bits=bits,
        exact=info.kind not in REQUANTIZED,
    )
