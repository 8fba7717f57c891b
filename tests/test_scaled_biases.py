"""Linears that hold a multiple of their scales instead of biases (compute/qmm.py
scaled_biases; issue 54): every path gives the numbers of the biases it stands for,
bit for bit, and a prepared model's layers then take a tenth less memory.

A symmetric quant's bias is -2^(bits-1) x its scale (weights/derived.py), so the
kernels read the scales twice and multiply by a power of two: exact. The paths
that are not the kernel (MLX's quantized_matmul, the prompt BLAS) make the biases
where they use them.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from gguf import GGMLQuantizationType as T

from flashserve.engine.compute import prompt_matmul, qmm
from flashserve.engine.config import EngineConfig
from flashserve.engine.generation import decode_step
from flashserve.engine.loader import load
from flashserve.engine.weights.layout import MANIFEST_NAME
from flashserve.engine.weights.prepare import prepare
from flashserve.engine.weights.synthetic import make_model_dir

from .gguf_writer import export_gguf
from .test_decode_step import decode


@pytest.fixture
def fast_path():
    assert qmm.select("fast") == "fast"  # this machine has the kernel: CI builds it
    x_bits = qmm.extension().x_bits()
    yield qmm.extension()
    qmm.extension().set_x_bits(x_bits)
    qmm.set_avx512(True)
    qmm.set_active(True)
    qmm.select("auto")


def symmetric(n: int, k: int, bits: int, group_size: int, dtype: mx.Dtype, seed: int = 0):
    """Quantized weights whose biases are -2^(bits-1) x their scales (as Q4_0's are)."""
    w = mx.random.normal((n, k), key=mx.random.key(seed))
    wq, scales, _ = mx.quantize(w, group_size=group_size, bits=bits)
    scales = scales.astype(dtype)
    times = -(1 << (bits - 1))
    return wq, scales, scales * mx.array(times, dtype=dtype), times


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=str)
@pytest.mark.parametrize("bits", [4, 5, 8])
def test_the_kernels_read_them_as_the_biases_they_stand_for(fast_path, dtype, bits):
    ext = fast_path
    for group_size in (32, 64):
        wq, scales, biases, times = symmetric(96, 256, bits, group_size, dtype, seed=bits)
        scaled = qmm.scaled_biases(times)
        assert scaled.ndim == 0 and scaled.dtype == mx.float32
        for rows in (1, 3, 17):
            x = mx.random.normal((rows, 256), key=mx.random.key(rows))
            for x_kind in qmm.DECODE_CHOICES:  # int16 and float kernels
                qmm.set_decode_matmul(x_kind)
                for avx512 in (True, False):
                    qmm.set_avx512(avx512)
                    want = ext.qmm(x, wq, scales, biases, group_size, bits)
                    got = ext.qmm(x, wq, scales, scaled, group_size, bits)
                    assert mx.array_equal(got, want).item(), (group_size, rows, x_kind, avx512)
                    fused = ext.qmm_multi(
                        x,
                        [wq, wq],
                        [scales, scales],
                        [scaled, biases],
                        [group_size] * 2,
                        [bits] * 2,
                    )
                    assert all(mx.array_equal(y, want).item() for y in fused)
            if bits in prompt_matmul.INTEGER_BITS:
                for x_bits in (16, 8):
                    want = ext.prompt_qgemm(x, [wq], [scales], [biases], group_size, bits, x_bits)
                    got = ext.prompt_qgemm(x, [wq], [scales], [scaled], group_size, bits, x_bits)
                    assert mx.array_equal(got[0], want[0]).item(), (group_size, rows, x_bits)


def _linear(wq, scales, biases, bits, group_size) -> nn.Module:
    linear = nn.QuantizedLinear(scales.shape[1] * group_size, wq.shape[0], False, group_size, bits)
    linear.update({"weight": wq, "scales": scales, "biases": biases})
    return linear


def test_mlx_kernel_and_prompt_blas_make_the_biases(fast_path):
    wq, scales, biases, times = symmetric(64, 256, 4, 32, mx.float16)
    full = _linear(wq, scales, biases, 4, 32)
    scaled = _linear(wq, scales, qmm.scaled_biases(times), 4, 32)
    for module in (full, scaled):  # the classes a loaded model's linears get
        prompt_matmul.use_blas_for_prompts(module, "float")
        assert qmm.use_fast_qmm(module) == 1
    one = mx.random.normal((1, 1, 256), key=mx.random.key(1))
    prompt = mx.random.normal((1, 300, 256), key=mx.random.key(2))  # past the decode rows
    for active in (True, False):  # the fast kernel, or MLX's (the bench turns it off)
        qmm.set_active(active)
        for x in (one, prompt):
            assert mx.array_equal(scaled(x), full(x)).item(), (active, x.shape)
    with pytest.raises(ValueError):  # MLX's own op cannot take them: only these paths do
        mx.quantized_matmul(one, wq, scales, qmm.scaled_biases(times), group_size=32, bits=4)


def test_a_prepared_model_holds_no_biases_its_scales_give(tmp_path, monkeypatch):
    src = make_model_dir(
        tmp_path / "src", "qwen3", overrides={"hidden_size": 256, "intermediate_size": 512}
    )
    model, _, config = mlx_lm.load(str(src), return_config=True)
    gguf = export_gguf(model, config, src, tmp_path / "q.gguf", qtype=lambda *_: T.Q4_0)
    out = prepare(str(gguf), tmp_path / "prepared")
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    derived = {e["index"]: sum(d["nbytes"] for d in e["derived"]) for e in manifest["layers"]}
    assert all(derived.values())
    prompts = [[5, 9, 13, 2], [7, 3, 11, 2, 8, 4, 6]]
    lengths = [24, 16]

    runs = {}
    for scaled in (True, False):
        for resident in (None, 1):  # every layer resident (compiled steps), or one
            with monkeypatch.context() as patch:
                if not scaled:  # the same kernel, the biases made in memory as before
                    patch.setattr(qmm, "takes_scaled_biases", lambda module: False)
                fixed = {"residency": "fixed", "resident_layers": resident} if resident else {}
                loaded = load(EngineConfig(model=str(out), **fixed))
            streamer = loaded.streamer
            assert streamer.scaled_biases is scaled
            assert len(streamer.streamed_layers) == (0 if resident is None else 3)
            for e in manifest["layers"]:  # what the plans count a layer as in memory
                less = derived[e["index"]] if scaled else 0
                assert streamer.layer_bytes(e["index"]) == e["tensor_bytes"] - less
            held = loaded.model.model.layers[0].self_attn.q_proj["biases"]
            assert held.ndim == (0 if scaled else 2)
            step = loaded.model if resident else decode_step.CompiledDecode(loaded.model)
            runs[scaled, resident] = decode(step, prompts, lengths, join_at=3)
            if resident is None:
                assert step.steps > 0 and not step.failed
    want = runs[False, None]
    for key, got in runs.items():
        assert got.keys() == want.keys()
        for uid, (tokens, logprobs) in want.items():
            assert got[uid][0] == tokens, (key, uid)
            for a, b in zip(got[uid][1], logprobs, strict=True):
                assert mx.array_equal(a, b).item(), (key, uid)  # every log-probability
