"""The integer prompt GEMM (engine/compute/csrc/prompt_qgemm*.cpp) and its accuracy on
real models (issue 57, items 1 and 2): prompt rows rounded to 8 or 16 bits per block
of 32, times MLX's 4- and 8-bit weights with integer dot products."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from flashserve.engine.bench.agent_turn import deviation
from flashserve.engine.compute import prompt_matmul, qmm
from flashserve.engine.compute.prompt_matmul import PromptQuantizedLinear
from flashserve.engine.config import EngineConfig
from flashserve.engine.loader import load
from flashserve.engine.weights.sources import default_model_path

from .test_gguf_gemma import gemma_path  # noqa: F401 (the Gemma GGUF, as a fixture)


@pytest.fixture(scope="module")
def ext():
    if qmm.select("auto") != "fast" or not prompt_matmul.integer_available():
        pytest.skip(f"the integer prompt GEMM does not run here: {qmm.unavailable_reason()}")
    return qmm.extension()


@pytest.fixture
def each_isa(ext) -> Iterator[list[str]]:
    """The instruction sets this CPU gives the GEMM, best first; the best one again after."""
    isas = ext.prompt_qgemm_isas()
    try:
        yield isas
    finally:
        ext.set_prompt_qgemm_isa("avx512vnni")


def emulated(x: mx.array, wq, scales, biases, group_size: int, bits: int, x_bits: int):
    """(x rounded as the GEMM rounds it @ W.T, exact x @ W.T), both in float64."""
    w = np.array(
        mx.dequantize(
            wq,
            scales.astype(mx.float32),
            biases.astype(mx.float32),
            group_size=group_size,
            bits=bits,
        )
    ).astype(np.float64)
    rows = np.array(x).astype(np.float64)
    blocks = rows.reshape(rows.shape[0], -1, 32)
    top = 127 if x_bits == 8 else 32767
    d = (np.abs(blocks).max(-1, keepdims=True) / top).astype(np.float32).astype(np.float64)
    rounded = (np.round(blocks / np.where(d == 0, 1, d)) * d).reshape(rows.shape)
    return rounded @ w.T, rows @ w.T


SHAPES = [(1, 128, 8), (38, 640, 50), (9, 512, 33), (67, 1280, 97)]  # (M, K, N)
# Rows left past the full row tiles: 1, 3, 4, 2 of 5 (AVX-512), 1, 2, 0, 1 of 3 (AVX-VNNI).


@pytest.mark.parametrize("x_bits", [8, 16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_kernel_matches_a_float_reference_on_every_isa(
    ext, each_isa, x_bits, bits, group_size, scale_dtype
):
    """Odd row counts, columns not a multiple of the tile, K over several chunks: every
    ISA path gives the rounded-x product (float64) to float32 rounding, the exact product
    within the rounding's error, and the same floats as every other path."""
    for m, k, n in SHAPES:
        key = mx.random.key(m * n + bits)
        x = mx.random.normal((m, k), key=key)
        wq, scales, biases = mx.quantize(
            mx.random.normal((n, k), key=mx.random.key(n)) * 0.05, group_size=group_size, bits=bits
        )
        scales, biases = scales.astype(scale_dtype), biases.astype(scale_dtype)
        want, exact = emulated(x, wq, scales, biases, group_size, bits, x_bits)
        outs = {}
        for isa in each_isa:
            ext.set_prompt_qgemm_isa(isa)
            assert ext.prompt_qgemm_isa() == isa
            (y,) = ext.prompt_qgemm(x, [wq], [scales], [biases], group_size, bits, x_bits)
            assert y.shape == (m, n) and y.dtype == mx.float32
            outs[isa] = np.array(y)
        scale = np.abs(exact).max()
        for isa, y in outs.items():
            assert np.abs(y - want).max() <= 2e-5 * scale, (isa, m, k, n)
            assert np.abs(y - exact).max() <= (3e-2 if x_bits == 8 else 2e-4) * scale, isa
            assert np.array_equal(y, outs[each_isa[0]]), isa


def test_a_row_depends_on_itself_alone(ext):
    """Any subset of rows, any thread count, weights called together or apart: each row's
    floats are the same (chunking, batching and caching give the same tokens)."""
    x = mx.random.normal((53, 512), key=mx.random.key(1))
    weights = [
        mx.quantize(mx.random.normal((n, 512), key=mx.random.key(n)), group_size=32, bits=4)
        for n in (96, 40, 40)
    ]
    ws, ss, bs = (list(t) for t in zip(*weights, strict=True))
    together = [np.array(y) for y in ext.prompt_qgemm(x, ws, ss, bs, 32, 4)]
    for i in range(3):
        (alone,) = ext.prompt_qgemm(x, [ws[i]], [ss[i]], [bs[i]], 32, 4)
        assert np.array_equal(np.array(alone), together[i])
    for rows in (slice(0, 1), slice(5, 22), slice(50, 53), slice(1, 53)):
        (part,) = ext.prompt_qgemm(x[rows], [ws[0]], [ss[0]], [bs[0]], 32, 4)
        assert np.array_equal(np.array(part), together[0][rows])
    threads = ext.threads()
    ext.set_threads(1)
    try:
        (one,) = ext.prompt_qgemm(x, [ws[0]], [ss[0]], [bs[0]], 32, 4)
    finally:
        ext.set_threads(threads)
    assert np.array_equal(np.array(one), together[0])


def prompt_linear(bits: int, bias: bool) -> tuple[nn.QuantizedLinear, PromptQuantizedLinear]:
    linear = nn.Linear(256, 72, bias=bias)
    linear.update({"weight": mx.random.normal((72, 256), key=mx.random.key(3))})
    plain = nn.QuantizedLinear.from_linear(linear, group_size=64, bits=bits)
    prompt = nn.QuantizedLinear(256, 72, bias=bias, group_size=64, bits=bits)
    prompt.update(plain.parameters())
    prompt.__class__ = qmm._fast_class(PromptQuantizedLinear)
    return plain, prompt


@pytest.mark.parametrize("bits", [4, 8])
def test_prompt_linear_takes_it_per_setting(ext, monkeypatch, bits):
    """prompt_matmul "int16"/"int8": prompt rows take the GEMM (no dequantize), within the
    rounding of the float path, the same rows whatever the chunk; "float": as before;
    a decode row keeps the few-row kernel."""
    plain, prompt = prompt_linear(bits, bias=True)
    model = nn.Sequential(prompt)
    x = mx.random.normal((1, 40, 256), key=mx.random.key(4))
    want = np.array(plain(x))
    dequantized = []
    real = prompt_matmul._dequantize
    monkeypatch.setattr(
        prompt_matmul, "_dequantize", lambda *a, **k: dequantized.append(1) or real(*a, **k)
    )
    for choice, tol in (("int16", 1e-4), ("int8", 3e-2)):
        prompt_matmul.set_prompt_matmul(model, choice)
        assert prompt_matmul.on_integer(prompt, x)
        whole = np.array(prompt(x))
        assert np.abs(whole - want).max() <= tol * np.abs(want).max()
        parts = [np.array(prompt(x[:, a:b])) for a, b in ((0, 17), (17, 38), (38, 40))]
        assert np.array_equal(np.concatenate(parts, axis=1), whole)
        assert dequantized == []
    prompt_matmul.set_prompt_matmul(model, "float")
    assert not prompt_matmul.on_integer(prompt, x)
    np.testing.assert_allclose(np.array(prompt(x)), want, rtol=1e-4, atol=1e-4)
    assert dequantized == [1]
    prompt_matmul.set_prompt_matmul(model, "int16")
    step = x[:, :1]
    plain.__class__ = qmm.FastQuantizedLinear
    assert mx.array_equal(prompt(step), plain(step)).item()  # decode: the few-row kernel
    with pytest.raises(ValueError):
        prompt_matmul.set_prompt_matmul(model, "int4")


# Accuracy on real models (issue 57's item 2). The texts are fixed: a few hundred
# positions of English, code and numbers, and short prompts for greedy agreement.
TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; "
    "Neil Armstrong and Buzz Aldrin walked on its surface while Michael Collins orbited "
    "above. def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, "
    "a + b\n    return a\n\nThe capital of France is Paris, and the capital of Italy is "
    "Rome. Water boils at 100 degrees Celsius at sea level, and freezes at 0. The "
    "mitochondria is the powerhouse of the cell. Shakespeare wrote Hamlet, Macbeth and "
    "King Lear. 2 + 2 = 4, 3 * 7 = 21, and the square root of 144 is 12. The Pacific "
    "Ocean is the largest ocean on Earth, covering about a third of its surface. In "
    "computing, a cache keeps recently used data close to the processor so that later "
    "reads are fast; when it is full, a policy such as least-recently-used decides what "
    "to evict. The French Revolution began in 1789 with the storming of the Bastille."
)
PROMPTS = deviation.PROMPTS  # the bench's accuracy table uses the same prompts
TOP5_BOUND = 0.02


def probabilities(model: nn.Module, ids: list[int]) -> np.ndarray:
    logits = model(mx.array([ids]))
    return np.array(mx.softmax(logits[0].astype(mx.float32), axis=-1))


def greedy(model: nn.Module, ids: list[int], tokens: int) -> list[int]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)
    out = []
    for _ in range(tokens):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)
    return out


def deviation(path: Path) -> tuple[float, float, float, bool]:
    """(max and mean change of the float path's top-5 probabilities, argmax agreement,
    greedy agreement on PROMPTS) of prompt_matmul "int16" against "float"."""
    loaded = load(EngineConfig(model=str(path)))
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = tokenizer.encode(TEXT)
    assert len(ids) >= 200
    prompt_matmul.set_prompt_matmul(model, "float")
    ref = probabilities(model, ids)
    ref_tokens = [greedy(model, tokenizer.encode(p), 12) for p in PROMPTS]
    prompt_matmul.set_prompt_matmul(model, "int16")
    got = probabilities(model, ids)
    tokens = [greedy(model, tokenizer.encode(p), 12) for p in PROMPTS]
    top = np.argsort(-ref, axis=-1)[:, :5]
    diff = np.abs(np.take_along_axis(ref, top, -1) - np.take_along_axis(got, top, -1))
    agree = float((ref.argmax(-1) == got.argmax(-1)).mean())
    return float(diff.max()), float(diff.mean()), agree, tokens == ref_tokens


def test_default_model_int16_keeps_float_probabilities(ext):
    worst, mean, agree, same_greedy = deviation(default_model_path())
    assert worst <= TOP5_BOUND, (worst, mean)
    assert agree == 1.0 and same_greedy


def test_gemma_q4_k_m_int16_keeps_float_probabilities(ext, gemma_path):  # noqa: F811
    worst, mean, agree, same_greedy = deviation(gemma_path)
    assert worst <= TOP5_BOUND, (worst, mean)
    assert agree == 1.0 and same_greedy
