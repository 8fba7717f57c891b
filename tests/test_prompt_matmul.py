"""Quantized linears run prompt tokens as dequantize + BLAS matmul
(engine/compute/prompt_matmul.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from flashserve.engine.compute import prompt_matmul
from flashserve.engine.compute.prompt_matmul import PromptQuantizedLinear
from flashserve.engine.config import EngineConfig
from flashserve.engine.loader import load
from flashserve.engine.weights.synthetic import make_model_dir


def quantized(bias: bool, bits: int = 4, group_size: int = 32) -> nn.QuantizedLinear:
    linear = nn.Linear(256, 96, bias=bias)
    linear.update({"weight": mx.random.normal((96, 256), key=mx.random.key(7))})
    if bias:
        linear.update({"bias": mx.random.normal((96,), key=mx.random.key(8))})
    return nn.QuantizedLinear.from_linear(linear, group_size=group_size, bits=bits)


def as_prompt(module: nn.QuantizedLinear) -> PromptQuantizedLinear:
    clone = nn.QuantizedLinear(
        256, 96, bias="bias" in module, group_size=module.group_size, bits=module.bits
    )
    clone.update(module.parameters())
    clone.__class__ = PromptQuantizedLinear
    return clone


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_prompt_rows_match_the_quantized_kernel(bias, bits):
    plain = quantized(bias, bits)
    prompt = as_prompt(plain)
    x = mx.random.normal((2, 7, 256), key=mx.random.key(9))
    np.testing.assert_allclose(np.array(prompt(x)), np.array(plain(x)), rtol=1e-4, atol=1e-4)


def test_decode_rows_keep_the_quantized_kernel_exactly():
    plain = quantized(bias=True)
    prompt = as_prompt(plain)
    x = mx.random.normal((5, 1, 256), key=mx.random.key(10))  # a batch of 5 decode tokens
    assert mx.array_equal(prompt(x), plain(x)).item()


def test_weight_is_dequantized_in_slices(monkeypatch):
    plain = quantized(bias=True)
    prompt = as_prompt(plain)
    x = mx.random.normal((1, 12, 256), key=mx.random.key(11))
    whole = prompt(x)
    calls = []
    real = mx.dequantize

    def spy(w, *args, **kwargs):
        calls.append(w.shape[0])
        return real(w, *args, **kwargs)

    monkeypatch.setattr(prompt_matmul, "SLICE_BYTES", 256 * 4 * 40)  # 40 rows of float32
    monkeypatch.setattr(prompt_matmul.mx, "dequantize", spy)
    sliced = prompt(x)
    assert calls == [40, 40, 16]
    np.testing.assert_allclose(np.array(sliced), np.array(whole), rtol=1e-6, atol=1e-6)


def test_loaded_quantized_model_uses_it_and_keeps_its_output(tmp_path):
    path = make_model_dir(tmp_path / "q4", "llama", quantize_bits=4)  # an untied LM head
    loaded = load(EngineConfig(model=str(path)))
    named = dict(loaded.model.named_modules())
    # The head's prompt logits are thrown away, so it keeps the lazy kernel path
    # (flashserve's few-row kernel on the CPU, compute/qmm.py; not the BLAS).
    assert not isinstance(named["lm_head"], PromptQuantizedLinear)
    modules = [m for n, m in named.items() if isinstance(m, nn.QuantizedLinear) and n != "lm_head"]
    assert len(modules) == 7 * loaded.config["num_hidden_layers"]
    assert all(isinstance(m, PromptQuantizedLinear) for m in modules)
    prompt = mx.array([list(range(3, 40))])
    logits = loaded.model(prompt)
    for module in modules:
        module.__class__ = nn.QuantizedLinear
    reference = loaded.model(prompt)
    np.testing.assert_allclose(np.array(logits), np.array(reference), rtol=1e-3, atol=1e-3)
    assert (mx.argmax(logits[0], -1) == mx.argmax(reference[0], -1)).all().item()


def test_float_weight_never_exists_whole(monkeypatch):
    """Peak memory holds one slice of float weight, not the whole matrix (16 MiB here)."""
    linear = nn.Linear(1024, 4096, bias=False)
    module = nn.QuantizedLinear.from_linear(linear, group_size=64, bits=4)
    module.__class__ = PromptQuantizedLinear
    x = mx.random.normal((1, 16, 1024), key=mx.random.key(12))
    mx.eval(module.parameters(), x)

    def peak(slice_bytes: int) -> int:
        monkeypatch.setattr(prompt_matmul, "SLICE_BYTES", slice_bytes)
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        y = module(x)
        mx.eval(y)
        assert y.shape == (1, 16, 4096)
        return mx.get_peak_memory() - base

    whole, sliced = peak(2**30), peak(2 * 2**20)  # one slice vs 8 slices
    assert whole > 16 * 2**20
    assert sliced < whole / 3
