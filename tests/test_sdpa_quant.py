"""Decode attention over kv_bits' packed cache (csrc/step_sdpa_quant.cpp) against its reference.

The reference is what the op replaced: the keys and values dequantized
(mx.dequantize) and MLX's own float attention over them. The op groups the
sums differently (s * (q . kq) + b * sum(q) per group; at AVX-512 the integers
as 1 + x / 2^bits), so it agrees to float32 rounding, not to the bit: measured
up to 1.3e-6 of the output's largest value over these shapes; the bound is
TOLERANCE. A cache read at the wrong group, nibble or position is off by
whole values (relative errors of 1e-2 and more). Each ISA loop is checked
(AVX-512 where the CPU has it, AVX2 with it forced off), and the properties
batching relies on hold to the bit: any thread count, a sequence alone or
left-padded in a batch, a fixed-capacity buffer's masked tail left out.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from flashserve.engine.compute import qmm, step_ops
from flashserve.engine.kv import cache as kv_cache

from .test_step_ops import on_one_thread

TOLERANCE = 2e-5  # relative to the output's largest value; measured 8e-6


@pytest.fixture(autouse=True)
def fast_path():
    assert qmm.select("fast") == "fast"  # this machine has the kernel: CI builds it
    step_ops.install()
    yield
    qmm.set_avx512(True)
    qmm.select("auto")


ISAS = ["avx512", "avx2"]


def use_isa(isa: str) -> None:
    on = qmm.set_avx512(isa == "avx512")
    if isa == "avx512" and not on:
        pytest.skip("no AVX-512 on this CPU")


def normal(shape: tuple[int, ...], seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed))


def packed(x: mx.array, group: int, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """x quantized as the cache keeps it, handed over as a slice of a longer buffer."""
    parts = mx.quantize(x, group_size=group, bits=bits)
    tail = [mx.zeros((*p.shape[:2], 16, p.shape[3]), p.dtype) for p in parts]
    return tuple(
        mx.concatenate([p, t], axis=2)[:, :, : x.shape[2]] for p, t in zip(parts, tail, strict=True)
    )


def inputs(b: int, hq: int, hk: int, lq: int, lk: int, dim: int, group: int, bits: int, seed: int):
    q = normal((b, hq, lq, dim), seed)
    # Keys with a per-head offset, as real keys have: the biases matter.
    k = packed(normal((b, hk, lk, dim), seed + 1) + 0.5, group, bits)
    v = packed(normal((b, hk, lk, dim), seed + 2), group, bits)
    return q, k, v


def reference(q, k, v, scale, mask, group, bits) -> mx.array:
    keys = mx.dequantize(*k, group_size=group, bits=bits)
    values = mx.dequantize(*v, group_size=group, bits=bits)
    sdpa = step_ops._state.original["scaled_dot_product_attention"]
    return sdpa(q, keys, values, scale=scale, mask=mask)


def op(q, k, v, scale, mask, group, bits) -> mx.array:
    out = step_ops.quantized_attention(q, k, v, scale, mask, group, bits)
    assert out is not None
    return out


def relative_error(got: mx.array, want: mx.array) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype
    return (mx.abs(got - want).max() / mx.abs(want).max()).item()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("dim", "group"), [(64, 32), (64, 64), (128, 64), (128, 128), (96, 32)])
def test_matches_dequantize_and_float_attention(isa, bits, dim, group):
    """Every group size and head size (96: the AVX2 loop even with AVX-512 on), GQA 1 and 4,
    one and several query rows, every mask kind, a batch whose second sequence is
    left-padded, key counts across chunk (256) and block (8) boundaries."""
    use_isa(isa)
    for hq, hk, lq, lk in [(4, 4, 1, 1), (8, 2, 1, 37), (8, 2, 3, 300), (6, 2, 1, 1100)]:
        q, k, v = inputs(2, hq, hk, lq, lk, dim, group, bits, seed=lk + dim)
        pad = mx.arange(lk)[None, None, None, :] >= mx.array([0, lk // 3]).reshape(2, 1, 1, 1)
        minus_inf = mx.where(mx.arange(lk) < lk // 4, -mx.inf, 0.0).reshape(1, 1, 1, lk)
        for mask in (None, "causal", pad, minus_inf):
            got = op(q, k, v, 0.125, mask, group, bits)
            want = reference(q, k, v, 0.125, mask, group, bits)
            assert relative_error(got, want) < TOLERANCE, (hq, hk, lq, lk, mask)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [8, 4])
def test_thread_count_and_left_padding_change_nothing(isa, bits):
    """The pool and the calling thread alone give the same bits; so does a sequence alone
    and left-padded in a batch (its keys shifted across chunk and block boundaries)."""
    use_isa(isa)
    lk, pad = 700, 517
    q, k, v = inputs(2, 9, 3, 1, lk + pad, 64, 64, bits, seed=3)
    keep = mx.arange(lk + pad)[None, None, None, :] >= mx.array([0, pad]).reshape(2, 1, 1, 1)
    batch = op(q, k, v, 0.125, keep, 64, bits)
    alone = on_one_thread(lambda: op(q, k, v, 0.125, keep, 64, bits))
    assert mx.array_equal(alone, batch).item()
    own = tuple(p[1:, :, pad:] for p in k), tuple(p[1:, :, pad:] for p in v)
    single = op(q[1:], *own, 0.125, None, 64, bits)
    assert mx.array_equal(single, batch[1:]).item()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("lk", [5, 300])
def test_a_buffers_masked_tail_is_left_out_to_the_bit(isa, lk):
    """A fixed-capacity buffer attends as one of exact length (keys no row sees at the end)."""
    use_isa(isa)
    tail = 211
    q, k, v = inputs(2, 4, 2, 1, lk + tail, 64, 64, 8, seed=4)
    positions = mx.arange(lk + tail)[None, None, None, :]
    pad = mx.array([0, lk // 2]).reshape(2, 1, 1, 1)
    got = op(q, k, v, 0.2, (positions >= pad) & (positions < lk), 64, 8)
    exact = tuple(p[:, :, :lk] for p in k), tuple(p[:, :, :lk] for p in v)
    want = op(q, *exact, 0.2, positions[..., :lk] >= pad, 64, 8)
    assert mx.array_equal(got, want).item()


def test_rows_with_strided_values_take_the_avx2_loop_correctly():
    """Packed rows whose last axis is not contiguous (a view with a step) are read through
    their strides (the AVX-512 loop reads rows in place, so this takes the AVX2 one)."""
    q = normal((1, 4, 1, 64), 11)
    k = mx.quantize(normal((1, 2, 50, 64), 12), group_size=32, bits=8)
    v = mx.quantize(normal((1, 2, 50, 64), 13), group_size=32, bits=8)
    # Every other column of a twice-as-wide array: the same values, last stride 2.
    wide = [mx.stack([p, mx.zeros_like(p)], axis=-1).reshape(*p.shape[:3], -1) for p in k]
    strided = tuple(w[..., ::2] for w in wide)
    assert all(mx.array_equal(s, p).item() for s, p in zip(strided, k, strict=True))
    got = op(q, strided, v, 0.125, None, 32, 8)
    assert relative_error(got, reference(q, k, v, 0.125, None, 32, 8)) < TOLERANCE


def test_the_cache_reads_packed_for_decode_and_dequantizes_prompt_chunks(monkeypatch):
    """kv/cache.py's attention: decode rows (at most SDPA_MAX_QUERIES) take the op, a
    prompt chunk and the switch turned off dequantize; all agree with the reference."""
    calls = []
    real = step_ops.quantized_attention

    def counted(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(step_ops, "quantized_attention", counted)
    for lq, packed_on, took in [(1, True, [True]), (20, True, [False]), (1, False, [])]:
        calls.clear()
        kv_cache.set_packed_attention(packed_on)
        try:
            q, k, v = inputs(1, 4, 2, lq, 300, 64, 64, 4, seed=lq)
            got = kv_cache._attention(q, k, v, 0.125, "causal", 64, 4)
        finally:
            kv_cache.set_packed_attention(True)
        assert calls == took
        assert relative_error(got, reference(q, k, v, 0.125, "causal", 64, 4)) < TOLERANCE
