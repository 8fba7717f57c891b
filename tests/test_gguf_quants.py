"""ggml tensor types -> MLX quantization, checked against llama.cpp's `gguf` package.

Each tensor is written to a real GGUF file with `gguf`'s writer, read back by
the engine's reader (weights/gguf/container.py), converted
(weights/gguf/quants.py), dequantized by MLX and compared with `gguf`'s own
numpy dequantizer: equal for the exact mappings, within half an 8-bit step
of each group's range for the re-quantized ones (Q6_K, Q2_K).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from flashserve.engine.weights.gguf.container import GGML_TYPES, GGUFError, GGUFFile
from flashserve.engine.weights.gguf.quants import Quantized, convert, pack

from .gguf_writer import encode, write_gguf

EXACT = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q3_K, T.Q4_K, T.Q5_K]
REQUANTIZED = [T.Q6_K, T.Q2_K]
FLOATS = [T.F32, T.F16, T.BF16]
BITS = {T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q8_0: 8, T.Q3_K: 8, T.Q4_K: 4, T.Q5_K: 5}
SHAPES = {"two_d": (24, 512), "experts": (3, 8, 256)}  # a linear; stacked experts


def _written(tmp_path: Path, qtype: T, shape: tuple[int, ...], seed: int = 0):
    """Write one tensor of `qtype`; return (the engine's view of the file, gguf's values)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape).astype(np.float32) * 0.05
    path = tmp_path / f"{qtype.name}.gguf"
    write_gguf(path, "llama", {}, [("w.weight", encode(values, qtype, rng), qtype)])
    reader = gguf.GGUFReader(path)
    (tensor,) = reader.tensors
    reference = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    return GGUFFile(path), reference


def _dequantized(q: Quantized) -> np.ndarray:
    # The scales as the runtime uses them: quantized matmuls convert them to the
    # (float32) input's dtype, and so does the engine's embedding (compute/half_scales.py).
    return np.array(
        mx.dequantize(
            mx.array(q.weight),
            mx.array(q.scales).astype(mx.float32),
            mx.array(q.biases).astype(mx.float32),
            group_size=32,
            bits=q.bits,
        )
    )


def test_type_table_matches_gguf():
    for qtype in T:
        name, block, size = GGML_TYPES[qtype.value]
        assert (name, (block, size)) == (qtype.name, gguf.GGML_QUANT_SIZES[qtype])


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packing_is_mlx_layout(bits):
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 1 << bits, (4, 64), dtype=np.uint8)
    ones, zeros = mx.ones((4, 2)), mx.zeros((4, 2))
    got = mx.dequantize(mx.array(pack(q, bits)), ones, zeros, group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(got), q.astype(np.float32))


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("qtype", EXACT, ids=lambda t: t.name)
def test_exact_types_dequantize_to_gguf_values(tmp_path, qtype, shape):
    file, reference = _written(tmp_path, qtype, shape)
    info = file.tensors["w.weight"]
    assert info.shape == shape and info.type_name == qtype.name
    q = convert(info, file.raw("w.weight"), np.float32)
    assert isinstance(q, Quantized) and q.exact and q.bits == BITS[qtype]
    assert q.weight.shape == (*shape[:-1], shape[-1] * q.bits // 32)
    # legacy types keep the file's float16 scales; K-quants need float32 to be exact
    assert q.scales.dtype == (np.float32 if qtype in (T.Q3_K, T.Q4_K, T.Q5_K) else np.float16)
    np.testing.assert_array_equal(_dequantized(q), reference)


@pytest.mark.parametrize("qtype", REQUANTIZED, ids=lambda t: t.name)
def test_requantized_types_stay_within_half_a_step(tmp_path, qtype):
    shape = SHAPES["two_d"]
    file, reference = _written(tmp_path, qtype, shape)
    q = convert(file.tensors["w.weight"], file.raw("w.weight"), np.float32)
    assert isinstance(q, Quantized) and not q.exact and q.bits == 8
    assert q.scales.dtype == np.float16  # approximate anyway: the smaller form
    error = np.abs(_dequantized(q) - reference).reshape(-1, 32)
    groups = reference.reshape(-1, 32)
    span = groups.max(axis=1) - groups.min(axis=1)
    step = q.scales.astype(np.float32).reshape(-1)
    # the bound docs/guides/gguf-and-prepare.md states: half a step, and a step is
    # range / 255 (rounded up)
    assert (error.max(axis=1) <= step / 2 * (1 + 1e-5) + 1e-9).all()
    assert (step <= span / 255 * (1 + 2**-9) + 2e-7).all()
    # a mean error well inside it: nearest rounding, no bias
    assert error.mean() < step.mean() / 3


@pytest.mark.parametrize("qtype", FLOATS, ids=lambda t: t.name)
def test_float_types_are_float_arrays(tmp_path, qtype):
    file, reference = _written(tmp_path, qtype, SHAPES["two_d"])
    out = convert(file.tensors["w.weight"], file.raw("w.weight"), np.float32)
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out.astype(np.float32), reference)


def test_float16_compute_rounds_k_quant_scales(tmp_path):
    # On a GPU the compute dtype is float16: K-quant scales are rounded to it.
    file, reference = _written(tmp_path, T.Q4_K, SHAPES["two_d"])
    q = convert(file.tensors["w.weight"], file.raw("w.weight"), np.float16)
    assert q.scales.dtype == np.float16
    # each of scale * q and bias off by at most half a float16 ulp (2^-11 relative)
    assert np.abs(_dequantized(q) - reference).max() <= 2**-10 * np.abs(reference).max()
    assert not np.array_equal(_dequantized(q), reference)


@pytest.mark.parametrize(
    "qtype", [T.IQ2_XXS, T.IQ4_NL, T.IQ4_XS, T.TQ1_0, T.MXFP4, T.Q8_1, T.I8], ids=lambda t: t.name
)
def test_refused_types_name_tensor_and_type(tmp_path, qtype):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((4, 256 // block * size), np.uint8)
    path = tmp_path / "refused.gguf"
    write_gguf(path, "llama", {}, [("blk.0.ffn_up.weight", raw, qtype)])
    file = GGUFFile(path)
    with pytest.raises(GGUFError, match=rf"blk\.0\.ffn_up\.weight has type {qtype.name}, which"):
        convert(file.tensors["blk.0.ffn_up.weight"], file.raw("blk.0.ffn_up.weight"), np.float32)


def test_scales_past_float16_range_stay_float32(tmp_path):
    # A Q8_0 block with d = 60000: -128 d overflows float16, so the tensor keeps float32.
    raw = np.zeros((2, 34), np.uint8)
    raw[:, 0:2] = np.array([60000, 1], np.float16).view(np.uint8).reshape(2, 2)
    raw[:, 2:] = np.arange(32, dtype=np.int8).view(np.uint8)
    path = tmp_path / "big.gguf"
    write_gguf(path, "llama", {}, [("w.weight", raw, T.Q8_0)])
    file = GGUFFile(path)
    q = convert(file.tensors["w.weight"], file.raw("w.weight"), np.float32)
    assert q.scales.dtype == np.float32
    np.testing.assert_array_equal(_dequantized(q), gguf.quants.dequantize(raw, T.Q8_0))
