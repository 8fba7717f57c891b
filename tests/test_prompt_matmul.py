"""Quantized linears run prompt tokens as dequantize + BLAS matmul
(engine/compute/prompt_matmul.py)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from flashserve.engine.compute import cores, prompt_matmul, qmm
from flashserve.engine.compute.prompt_matmul import PromptQuantizedLinear
from flashserve.engine.config import EngineConfig
from flashserve.engine.loader import load
from flashserve.engine.weights.synthetic import make_model_dir

from .conftest import REPO


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
    real = prompt_matmul._dequantize

    def spy(w, *args, **kwargs):
        calls.append(w.shape[0])
        return real(w, *args, **kwargs)

    monkeypatch.setattr(prompt_matmul, "SLICE_BYTES", 256 * 4 * 40)  # 40 rows of float32
    monkeypatch.setattr(prompt_matmul, "_dequantize", spy)
    sliced = prompt(x)
    assert calls == [40, 40, 16]
    np.testing.assert_allclose(np.array(sliced), np.array(whole), rtol=1e-6, atol=1e-6)


def test_a_kept_weight_is_dequantized_once_with_the_same_numbers(monkeypatch):
    """keep_dequantized (a layer-major prefill's round): a linear called on several chunks
    dequantizes its weight once, and each chunk's output is the one made without keeping."""
    plain = quantized(bias=True)
    prompt = as_prompt(plain)
    chunks = [mx.random.normal((1, n, 256), key=mx.random.key(20 + n)) for n in (12, 12, 5)]
    alone = [prompt(x) for x in chunks]
    calls = []
    real = prompt_matmul._dequantize

    def spy(w, *args, **kwargs):
        calls.append(w.shape[0])
        return real(w, *args, **kwargs)

    monkeypatch.setattr(prompt_matmul, "_dequantize", spy)
    with prompt_matmul.keep_dequantized():
        kept = [prompt(x) for x in chunks]
        assert calls == [96]
        # Another weight in the same module (a streamed layer's arrays swapped): made afresh.
        other = quantized(bias=True, bits=8)
        prompt.update(other.parameters())
        prompt.bits = 8
        swapped = prompt(chunks[0])
        assert calls == [96, 96]
    assert all(mx.array_equal(a, b).item() for a, b in zip(alone, kept, strict=True))
    np.testing.assert_allclose(np.array(swapped), np.array(other(chunks[0])), rtol=1e-4, atol=1e-4)
    prompt(chunks[0])  # the block is over: nothing is kept
    assert calls == [96, 96, 96]
    assert prompt_matmul._kept.slices is None


@pytest.mark.usefixtures("float_decode_x")  # against the BLAS rows to float rounding
@pytest.mark.parametrize("bits", [4, 8])
def test_large_weights_take_the_kernel_as_decode_does(monkeypatch, bits):
    """A weight whose float copy reaches KERNEL_MIN_FLOAT_BYTES runs its prompt rows on
    flashserve's kernel (never dequantized): each row is what a decode step computes."""
    ext = qmm.extension()
    if qmm.select("auto") != "fast" or not ext.avx512_active():
        pytest.skip("the kernel's AVX-512 path does not run here")
    plain = quantized(bias=True, bits=bits)
    prompt = as_prompt(plain)
    prompt.__class__ = qmm._fast_class(PromptQuantizedLinear)
    x = mx.random.normal((1, 20, 256), key=mx.random.key(30))
    calls = []
    real = prompt_matmul._dequantize
    monkeypatch.setattr(
        prompt_matmul, "_dequantize", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    blas_rows = prompt(x)
    assert calls == [1]  # 96 x 256 floats: far below the threshold, dequantize + BLAS
    monkeypatch.setattr(prompt_matmul, "KERNEL_MIN_FLOAT_BYTES", 96 * 256 * 4)
    assert prompt_matmul.on_kernel(prompt, x)
    kernel_rows = prompt(x)
    assert calls == [1]
    one_by_one = mx.concatenate([prompt(x[:, i : i + 1]) for i in range(20)], axis=1)
    assert mx.array_equal(kernel_rows, one_by_one).item()
    np.testing.assert_allclose(np.array(kernel_rows), np.array(blas_rows), rtol=1e-4, atol=1e-4)
    qmm.set_avx512(False)
    try:
        assert not prompt_matmul.on_kernel(prompt, x)  # AVX2's kernel: the BLAS is faster
    finally:
        qmm.set_avx512(True)


@pytest.mark.parametrize("path_", ["integer", "kernel"])
def test_a_short_chunk_is_evaluated_once_with_the_same_numbers(tmp_path, monkeypatch, path_):
    """A chunk of fewer than EVAL_EACH_FROM_ROWS tokens (an agent's next turn) is left
    lazy on the integer GEMM and on the kernel: no evaluation inside its linears (each
    waited for MLX's stream), one for the chunk, as a decode step. Its logits are those of
    the chunk evaluated linear by linear, bit for bit, on one thread (11 rows) and on
    every core (40 rows); a longer chunk still evaluates each linear (one chunk's
    activations at a time)."""
    if path_ == "integer" and not prompt_matmul.integer_available():
        pytest.skip("the integer prompt GEMM does not run here")
    if path_ == "kernel":
        if qmm.select("auto") != "fast" or not qmm.extension().avx512_active():
            pytest.skip("the kernel's AVX-512 path does not run here")
        monkeypatch.setattr(prompt_matmul, "KERNEL_MIN_FLOAT_BYTES", 0)
    path = make_model_dir(tmp_path / "q4", "llama", quantize_bits=4)
    choice = "int16" if path_ == "integer" else "float"
    model = load(EngineConfig(model=str(path), prompt_matmul=choice)).model
    chunks = (prompt_matmul.EVAL_EACH_FROM_ROWS + 5, 40, 11)
    prompt = mx.array([[(37 * i) % 200 + 3 for i in range(sum(chunks))]])
    evals: list[int] = []
    real_eval = mx.eval

    def counted(*args):
        evals.append(1)
        return real_eval(*args)

    def run() -> tuple[mx.array, list[int]]:
        cache = make_prompt_cache(model)
        per_chunk = []
        start, outs = 0, []
        for n in chunks:
            evals.clear()
            with monkeypatch.context() as m:
                m.setattr(prompt_matmul.mx, "eval", counted)
                outs.append(model(prompt[:, start : start + n], cache=cache)[:, -1])
            per_chunk.append(len(evals))
            mx.eval(outs[-1])
            start += n
        return mx.concatenate(outs), per_chunk

    assert prompt_matmul.MIN_THREADED_ROWS <= 40 < prompt_matmul.EVAL_EACH_FROM_ROWS
    lazy, lazy_evals = run()
    monkeypatch.setattr(prompt_matmul, "EVAL_EACH_FROM_ROWS", 2)
    each, each_evals = run()
    layers = len(model.layers)
    assert lazy_evals[0] >= 4 * layers and each_evals[0] == lazy_evals[0]  # long: each
    assert lazy_evals[1:] == [0, 0]  # 40 and 11 rows: not one evaluation inside the chunk
    assert min(each_evals[1:]) >= 4 * layers
    assert mx.array_equal(lazy, each).item()


@pytest.mark.parametrize("choice", ["float", "int16"])
def test_loaded_quantized_model_uses_it_and_keeps_its_output(tmp_path, choice):
    path = make_model_dir(tmp_path / "q4", "llama", quantize_bits=4)  # an untied LM head
    loaded = load(EngineConfig(model=str(path), prompt_matmul=choice))
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


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_dequantize_op_gives_mlx_numbers_bit_for_bit(bits, group_size):
    """flashserve's dequantize (csrc/prompt_dequant.cpp, on the kernel's threads) is
    mx.dequantize exactly, float16 scales included (a GGUF's, cast to float32)."""
    ext = qmm.extension()
    if ext is None or not hasattr(ext, "dequantize"):
        pytest.skip(f"the CPU extension does not run here: {qmm.unavailable_reason()}")
    w = mx.random.normal((300, 1024), key=mx.random.key(bits * group_size)) * 3
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    for s, b in ((scales, biases), (scales.astype(mx.float16), biases.astype(mx.float16))):
        s32, b32 = s.astype(mx.float32), b.astype(mx.float32)
        want = mx.dequantize(wq, s32, b32, group_size=group_size, bits=bits)
        got = ext.dequantize(wq, s32, b32, group_size, bits)
        assert got.dtype == mx.float32 and got.shape == (300, 1024)
        assert mx.array_equal(got, want).item()
    # A slice of rows (what prompt_matmul hands it) is a view MLX makes contiguous.
    part = ext.dequantize(wq[100:200], scales[100:200], biases[100:200], group_size, bits)
    want = mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits)
    assert mx.array_equal(part, want[100:200]).item()


def test_usable_cores_follow_the_cgroup_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert cores.usable(tmp_path) == affinity  # no cgroup files: the affinity mask
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cores.quota_cores(tmp_path) is None
    assert cores.usable(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a core
    assert cores.quota_cores(tmp_path) == 0.5
    assert cores.usable(tmp_path) == 1
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()  # cgroup v1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cores.quota_cores(tmp_path) == 1.5
    assert cores.usable(tmp_path) == min(affinity, 2)  # 1.5 cores: a second thread still gains


# Runs in a fresh interpreter: MKL must be chosen before mlx is imported. A real
# quantized model (files) prefills prompts of several lengths on one thread with
# MLX's dequantize (the path before issue 42) and on every core; records the
# thread counts MKL was given.
PARALLEL_PROBE = """
import json, sys
from flashserve.engine.compute import blas
blas.select("auto")
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from flashserve.engine.compute import cores, prompt_matmul, qmm
from flashserve.engine.config import EngineConfig
from flashserve.engine.loader import load

if sys.argv[2] == "kernel":  # every linear's prompt rows on flashserve's kernel
    prompt_matmul.KERNEL_MIN_FLOAT_BYTES = 0
integer = []  # calls of the integer GEMM (prompt_matmul "int16")
real_int = prompt_matmul._integer_output
def spy_int(*args):
    integer.append(1)
    return real_int(*args)
prompt_matmul._integer_output = spy_int
fast = qmm.select("auto") == "fast"
kernel = sys.argv[2] == "kernel" and fast and qmm.extension().avx512_active()
counts = []
real = blas._set_threads
def spy(n):
    counts.append((n, blas.mkl_threads()))
    real(n)
blas._set_threads = spy
inside = []
real_dq = prompt_matmul._dequantize
def dq(*args):
    inside.append(blas.mkl_threads())
    return real_dq(*args)
prompt_matmul._dequantize = dq

choice = "int16" if sys.argv[2] == "integer" else "float"
model = load(EngineConfig(model=sys.argv[1], prompt_matmul=choice)).model
prompt = mx.array([[(37 * i) % 200 + 3 for i in range(240)]])

def run(chunks):
    cache = make_prompt_cache(model)
    start, outs = 0, []
    for n in chunks:
        outs.append(model(prompt[:, start:start + n], cache=cache)[:, -1])
        mx.eval(outs[-1])
        start += n
    return outs[-1]

out = {}
for on in (False, True):
    prompt_matmul.set_parallel(on)
    inside.clear()
    out[str(on)] = {
        str(chunks): run(chunks).tolist()
        for chunks in ([240], [200, 40], [229, 11], [3, 237], [120, 5, 115])
    }
    out["inside" + str(on)] = sorted(set(inside))
print(json.dumps({"out": out, "counts": counts, "threaded": blas.threaded(), "kernel": kernel,
                  "integer": len(integer), "integer_runs": prompt_matmul.integer_available(),
                  "usable": prompt_matmul.prompt_threads(), "after": blas.mkl_threads()}))
"""


@pytest.mark.parametrize("linears", ["blas", "kernel", "integer"])
def test_every_core_prefill_gives_the_one_thread_numbers(tmp_path, linears):
    """Prompt chunks on every core (threaded MKL, flashserve's dequantize) give the logits
    of one thread with MLX's dequantize bit for bit, whatever the chunking (cold, after a
    cached prefix of 3 to 229 tokens); MKL gets every usable core inside a chunk of >= 16
    rows and one after it. Also where every linear's prompt rows take flashserve's kernel
    (weights of KERNEL_MIN_FLOAT_BYTES and more): attention's matmuls, computed with
    o_proj's input, still get every core. And on the integer GEMM (prompt_matmul
    "int16", the default): no weight dequantized, the same next token whatever the
    chunking."""
    path = make_model_dir(tmp_path / "q4", "llama", quantize_bits=4)
    result = subprocess.run(
        [sys.executable, "-c", PARALLEL_PROBE, str(path), linears],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    before, after = got["out"]["False"], got["out"]["True"]
    assert before == after  # each chunking: the same floats on every core as on one
    cold = np.array(after["[240]"])
    for logits in after.values():  # cold or after a cached prefix: the same next token
        assert np.argmax(logits) == np.argmax(cold)
        np.testing.assert_allclose(logits, cold, rtol=1e-4, atol=1e-4)
    if sys.platform == "linux" and platform.machine() == "x86_64" and got["usable"] > 1:
        assert got["threaded"]  # the mkl wheel brings Intel's OpenMP runtime
        # Set to every core for each >= 16-row chunk's evaluation, then back to one:
        # MKL reports the count it was given.
        counts = [tuple(c) for c in got["counts"]]  # (count set, count MKL had before)
        assert {n for n, _ in counts} == {got["usable"], 1}
        assert (got["usable"], 1) in counts and (1, got["usable"]) in counts
        assert got["after"] == 1
        if linears == "integer" and got["integer_runs"]:
            assert got["integer"] > 0
            assert got["out"]["insideTrue"] == got["out"]["insideFalse"] == []
        elif got["kernel"]:  # nothing dequantized: the kernel took every linear
            assert got["out"]["insideTrue"] == got["out"]["insideFalse"] == []
        else:
            assert got["out"]["insideFalse"] == [1]  # one thread before issue 42's change
