"""The int16 decode kernel (engine/compute/csrc/qmm_avx512_int.cpp, the `decode_matmul`
setting's "int16"): few-row matmuls with x rounded per block of 32 as the prompt GEMM
rounds it, integer dot products on 4- and 8-bit weights (issue 57's decode, issue 54)."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import pytest

from flashserve.engine.compute import prompt_matmul, qmm
from flashserve.engine.config import EngineConfig
from flashserve.engine.loader import load
from flashserve.engine.speculative.draft import DraftModel
from flashserve.engine.weights.sources import default_model_path

from .test_gguf_gemma import gemma_path  # noqa: F401 (the Gemma GGUF, as a fixture)
from .test_prompt_qgemm import TEXT, TOP5_BOUND, emulated, greedy, probabilities


@pytest.fixture
def ext() -> Iterator:
    if qmm.select("auto") != "fast":
        pytest.skip(f"the kernel does not run here: {qmm.unavailable_reason()}")
    module = qmm.extension()
    before = module.x_bits()
    qmm.set_decode_matmul("int16")
    try:
        yield module
    finally:
        module.set_x_bits(before)
        qmm.set_vnni(True)
        qmm.set_avx512(True)


def each_path(ext) -> Iterator[tuple[str, bool]]:
    """Every path this CPU has, the others forced off: the AVX-512 kernel (where the CPU
    has it) and the AVX2 one, each with VNNI (AVX-512 VNNI, AVX-VNNI) where present and
    with vpmaddwd (VNNI forced off)."""
    for avx512 in (True, False):
        if qmm.set_avx512(avx512) != avx512:
            continue
        for vnni in (True, False):
            if qmm.set_vnni(vnni) == vnni:
                yield ("AVX-512" if avx512 else "AVX2"), vnni
    qmm.set_avx512(True)
    qmm.set_vnni(True)


SHAPES = [(1, 576, 37), (3, 160, 19), (4, 1536, 64), (9, 4096, 8), (2, 192, 130)]  # (M, K, N)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_kernel_matches_the_rounded_float_reference_on_every_isa(
    ext, bits, group_size, scale_dtype
):
    """K over whole and short chunks, 1-9 rows: the rounded-x product (float64) to float32
    rounding, the exact product within the rounding's error, the same floats with and
    without VNNI, and each row's floats the same alone as with the others."""
    for m, k, n in SHAPES:
        if k % group_size:
            continue
        x = mx.random.normal((m, k), key=mx.random.key(m * n + bits))
        wq, scales, biases = mx.quantize(
            mx.random.normal((n, k), key=mx.random.key(n)) * 0.05, group_size=group_size, bits=bits
        )
        scales, biases = scales.astype(scale_dtype), biases.astype(scale_dtype)
        want, exact = emulated(x, wq, scales, biases, group_size, bits, 16)
        scale = np.abs(exact).max()
        outs: dict[str, list[np.ndarray]] = {}
        for isa, vnni in each_path(ext):
            y = np.array(qmm.quantized_matmul(x, wq, scales, biases, group_size, bits))
            assert np.abs(y - want).max() <= 2e-5 * scale, (isa, vnni, m, k, n)
            assert np.abs(y - exact).max() <= 2e-4 * scale, (isa, vnni, m, k, n)
            outs.setdefault(isa, []).append(y)
            for row in range(m):
                alone = qmm.quantized_matmul(x[row : row + 1], wq, scales, biases, group_size, bits)
                assert np.array_equal(np.array(alone)[0], y[row]), (isa, vnni, row)
        assert "AVX2" in outs  # every machine the kernel builds for has it
        for ys in outs.values():  # VNNI or not: the same integers, the same floats
            assert all(np.array_equal(y, ys[0]) for y in ys)


def test_rows_threads_and_the_setting(ext):
    """Any thread count gives the same floats, on each ISA; "float" gives the float
    kernel's (which differ from int16's), and the setting is refused with a typo."""
    wq, scales, biases = mx.quantize(
        mx.random.normal((1536, 576), key=mx.random.key(7)), group_size=32, bits=4
    )
    x = mx.random.normal((5, 576), key=mx.random.key(8))
    for _isa, _vnni in each_path(ext):
        together = np.array(qmm.quantized_matmul(x, wq, scales, biases, 32, 4))
        try:
            qmm.set_threads(1)
            one = np.array(qmm.quantized_matmul(x, wq, scales, biases, 32, 4))
        finally:
            qmm.set_threads(0)
        assert np.array_equal(one, together)
    together = np.array(qmm.quantized_matmul(x, wq, scales, biases, 32, 4))
    assert qmm.decode_matmul() == "int16"
    qmm.set_decode_matmul("float")
    assert qmm.decode_matmul() == "float"
    floats = np.array(qmm.quantized_matmul(x, wq, scales, biases, 32, 4))
    assert not np.array_equal(floats, together)
    want = np.array(mx.quantized_matmul(x, wq, scales, biases, group_size=32, bits=4))
    assert np.abs(floats - want).max() <= 2e-5 * np.abs(want).max()
    with pytest.raises(qmm.QmmError):
        qmm.set_decode_matmul("int8")


def decode_deviation(path) -> tuple[float, float, bool]:
    """(max and mean change of the float path's top-5 probabilities over TEXT's positions,
    greedy agreement over 24 tokens) of decode_matmul "int16" against "float"; every
    position through the few-row kernel as decode rows, prompt rows on the float path."""
    loaded = load(EngineConfig(model=str(path), prompt_matmul="float"))
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = tokenizer.encode(TEXT)
    assert qmm.decode_matmul() == "int16"  # the default, set at load
    results = {}
    for choice in ("float", "int16"):
        qmm.set_decode_matmul(choice)
        with prompt_matmul.decode_rows(len(ids)):
            probs = probabilities(model, ids)
        results[choice] = (probs, greedy(model, ids[:40], 24))
    ref, got = results["float"][0], results["int16"][0]
    top = np.argsort(-ref, axis=-1)[:, :5]
    diff = np.abs(np.take_along_axis(ref, top, -1) - np.take_along_axis(got, top, -1))
    return float(diff.max()), float(diff.mean()), results["float"][1] == results["int16"][1]


def test_default_model_int16_decode_keeps_float_probabilities(ext):
    worst, mean, same_greedy = decode_deviation(default_model_path())
    assert worst <= TOP5_BOUND, (worst, mean)
    assert mean > 0.0  # the rows really were rounded: int16 is not the float path
    assert same_greedy


def test_gemma_q4_k_m_int16_decode_keeps_float_probabilities(ext, gemma_path):  # noqa: F811
    worst, mean, same_greedy = decode_deviation(gemma_path)
    assert worst <= TOP5_BOUND, (worst, mean)
    assert mean > 0.0
    assert same_greedy


def test_a_draft_model_load_keeps_the_process_setting(ext):
    """decode_matmul is process-wide: loading the draft model for speculative decoding
    (its own EngineConfig) must not reset a server's "float" to the default."""
    loaded = load(EngineConfig(model=str(default_model_path()), decode_matmul="float"))
    assert qmm.decode_matmul() == "float"
    DraftModel.load(str(default_model_path()), loaded.tokenizer)
    assert qmm.decode_matmul() == "float"
