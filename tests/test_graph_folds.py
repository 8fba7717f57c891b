"""Ops that read through views and compute their input's op (csrc/graph_folds.h, step_ops.h).

A fold must not change a number: each case builds the op on a graph it can
fold and on the same values evaluated first (nothing to fold: an evaluated
array has no primitive), and asserts the two are equal to the bit, and that
the folded graph lacks the nodes it saves.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import mlx.core as mx
import pytest

from flashserve.engine.compute import qmm, step_ops


@pytest.fixture
def ext():
    assert qmm.select("fast") == "fast"  # this machine has the kernel: CI builds it
    step_ops.install()
    yield qmm.extension()
    qmm.select("auto")


def normal(shape: tuple[int, ...], seed: int) -> mx.array:
    return evaluated(mx.random.normal(shape, key=mx.random.key(seed)))


def nodes(out: mx.array, tmp_path: Path) -> Counter:
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), out)
    return Counter(re.findall(r'label ="([A-Za-z]+)', path.read_text()))


def evaluated(a: mx.array) -> mx.array:
    mx.eval(a)
    return a


def quantized(n: int, k: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    w, s, b = mx.quantize(normal((n, k), seed), group_size=32, bits=4)
    mx.eval(w, s, b)
    return w, s, b


@pytest.mark.parametrize("tokens", [1, 5])
def test_rope_reads_the_projection_its_heads_are_split_from(ext, tmp_path: Path, tokens: int):
    B, H, D = 2, 3, 16
    offset = mx.array([4, 9], dtype=mx.int32)
    projection = evaluated(normal((B, tokens, H * D), 1) * 3)
    heads = projection.reshape(B, tokens, H, D).transpose(0, 2, 1, 3)
    folded = ext.rope(heads, offset, [], D, False, 10000.0, 1.0)
    assert nodes(folded, tmp_path) == Counter({"FlashserveRoPE": 1})
    plain = ext.rope(evaluated(heads), offset, [], D, False, 10000.0, 1.0)
    assert folded.shape == plain.shape == (B, H, tokens, D)
    assert mx.array_equal(folded, plain).item()


def test_rope_reads_per_head_normed_queries_before_their_transpose(ext, tmp_path: Path):
    B, L, H, D = 2, 3, 4, 8  # Qwen 3: RMSNorm per head, then transpose, then RoPE
    normed = ext.rms_norm(normal((B, L, H, D), 2), [normal((D,), 3)], 1e-6)
    heads = normed.transpose(0, 2, 1, 3)
    folded = ext.rope(heads, mx.array(7, dtype=mx.int32), [], 6, True, 500.0, 0.5)
    assert "Transpose" not in nodes(folded, tmp_path)
    plain = ext.rope(evaluated(heads), mx.array(7, dtype=mx.int32), [], 6, True, 500.0, 0.5)
    assert mx.array_equal(folded, plain).item()


def test_output_projection_reads_the_attention_heads(ext, tmp_path: Path):
    B, H, D, N = 3, 4, 32, 40
    w, s, b = quantized(N, H * D, 4)
    q = normal((B, H, 1, D), 5)
    k = v = normal((B, H // 2, 7, D), 6)
    attention = ext.sdpa(q, k, v, [], 0, D**-0.5)
    merged = attention.transpose(0, 2, 1, 3).reshape(B, 1, H * D)
    folded = ext.qmm(merged, w, s, b, 32, 4)
    ops = nodes(folded, tmp_path)
    assert "Transpose" not in ops and "Reshape" not in ops
    plain = ext.qmm(evaluated(merged), w, s, b, 32, 4)
    assert folded.shape == plain.shape == (B, 1, N)
    assert mx.array_equal(folded, plain).item()
    # Several positions: the transpose moves elements, so it stays.
    many = normal((B, H, 3, D), 7).transpose(0, 2, 1, 3).reshape(B, 3, H * D)
    assert "Transpose" in nodes(ext.qmm(many, w, s, b, 32, 4), tmp_path)


@pytest.mark.parametrize("rows", [1, 4])
def test_rms_norm_and_swiglu_are_computed_by_the_matmul_they_feed(ext, tmp_path: Path, rows: int):
    K, N = 64, 48
    x, weight = normal((rows, 1, K), 8), normal((K,), 9)
    (w1, s1, b1), (w2, s2, b2) = quantized(N, K, 10), quantized(N + 16, K, 11)
    normed = ext.rms_norm(x, [weight], 1e-5)
    folded = ext.qmm_multi(normed, [w1, w2], [s1, s2], [b1, b2], [32, 32], [4, 4])
    ops = nodes(folded[0], tmp_path)
    assert "FlashserveRMSNorm" not in ops and ops["FlashserveQMMMulti"] == 1
    plain = ext.qmm_multi(evaluated(normed), [w1, w2], [s1, s2], [b1, b2], [32, 32], [4, 4])
    for got, want in zip(folded, plain, strict=True):
        assert mx.array_equal(got, want).item()

    gate, up = normal((rows, 1, K), 12), normal((rows, 1, K), 13)
    activated = ext.swiglu(gate, up)
    folded = ext.qmm(activated, w1, s1, b1, 32, 4)
    assert "FlashserveSwiGLU" not in nodes(folded, tmp_path)
    plain = ext.qmm(evaluated(activated), w1, s1, b1, 32, 4)
    assert mx.array_equal(folded, plain).item()


def test_a_folded_op_read_elsewhere_too_is_still_computed_once_there(ext, tmp_path: Path):
    K, N = 64, 32
    w, s, b = quantized(N, K, 14)
    normed = ext.rms_norm(normal((2, K), 15), [], 1e-6)  # no weight
    out = ext.qmm(normed, w, s, b, 32, 4) + normed.sum(axis=-1, keepdims=True)
    ops = nodes(out, tmp_path)
    assert ops["FlashserveRMSNorm"] == 1  # for the sum; the matmul computes its own
    want = ext.qmm(evaluated(normed), w, s, b, 32, 4) + normed.sum(axis=-1, keepdims=True)
    assert mx.array_equal(out, want).item()


@pytest.mark.parametrize("at", [0, 5, 14])
def test_cache_write_stores_what_slice_update_stores_and_never_touches_a_shared_buffer(
    ext, tmp_path: Path, at: int
):
    B, H, C, D = 2, 3, 16, 8
    buffer = normal((B, H, C, D), 16)
    projection = normal((B, 1, H * D), 17)
    values = projection.reshape(B, 1, H, D).transpose(0, 2, 1, 3)  # as attention splits them
    position = mx.array([at], dtype=mx.int32)
    want = mx.slice_update(buffer, evaluated(values), position, axes=(2,))
    # `buffer` is still referenced here, so the op must write a copy.
    got = ext.cache_write(buffer, values, position)
    assert nodes(got, tmp_path) == Counter({"FlashserveCacheWrite": 1})
    assert mx.array_equal(got, want).item()
    assert mx.array_equal(buffer, normal((B, H, C, D), 16)).item()  # untouched
    # Past the end (never asked for: the step grows buffers first), the
    # write moves back into the buffer rather than past it.
    keys = normal((B, H, 2, D), 18)
    got = ext.cache_write(buffer, keys, mx.array([C - 1], dtype=mx.int32))
    assert mx.array_equal(got[:, :, C - 2 :], keys).item()
