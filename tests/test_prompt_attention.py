"""Prompt chunks' attention on the CPU (compute/prompt_attention.py, issue 42).

It must agree with MLX's composed attention to float32 rounding for every
mask kind, and give a prompt position the same numbers whatever chunk it is
prefilled in: cold (chunks from token 0) and on top of a cached prefix (chunks
from the prefix's end) then produce the same tokens.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask

from flashserve.engine.compute import prompt_attention, qmm, step_ops

from .test_step_ops import TOLERANCE, attention_inputs, mlx_op, normal, relative_error


@pytest.fixture(autouse=True)
def fast_path():
    assert qmm.select("fast") == "fast"
    step_ops.install()
    yield
    qmm.select("auto")


def test_prompt_attention_matches_mlx_for_every_mask_kind():
    q, k, v = attention_inputs(37, 101, seed=3)  # 8 query heads over 2 kv heads
    lq, lk = q.shape[2], k.shape[2]
    causal = create_causal_mask(lq, lk - lq)
    left_padded = causal & (mx.arange(lk) >= mx.array([[3], [0]]))[:, None, None, :]
    per_head = normal((2, 8, lq, lk), 4) * 0.5 + mx.where(causal, 0.0, -mx.inf)
    for mask in (None, "causal", causal, left_padded, per_head):
        got = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
        want = mlx_op("scaled_dot_product_attention")(q, k, v, scale=0.2, mask=mask)
        assert relative_error(got, want) < TOLERANCE


def test_a_position_gets_the_same_numbers_in_any_chunk():
    """Query rows at positions 193..232 against 233 keys, and the same positions cut
    into other chunks (ending at key 214, starting at other rows, so rows pair up
    differently inside the op): each position's output agrees bit for bit."""
    ext = qmm.extension()
    q = normal((1, 6, 40, 64), 5)  # 6 query heads over 2 kv heads
    k = normal((1, 2, 240, 64), 6)[:, :, :233]
    v = normal((1, 2, 240, 64), 7)[:, :, :233]
    for mode in (1, 2):
        whole = ext.prompt_sdpa(
            q, k, v, [] if mode == 1 else [create_causal_mask(40, 193)], mode, 0.125
        )
        for first, last in ((0, 21), (3, 21), (5, 6), (1, 40)):
            rows = last - first  # positions 193 + first .. 193 + last - 1
            keys = 193 + last
            mask = [] if mode == 1 else [create_causal_mask(rows, keys - rows)]
            part = ext.prompt_sdpa(
                q[:, :, first:last], k[:, :, :keys], v[:, :, :keys], mask, mode, 0.125
            )
            assert mx.array_equal(whole[:, :, first:last], part).item(), (mode, first, last)


def test_the_numbers_are_the_same_with_and_without_avx512():
    """Where AVX-512 is there, its registers hold four rows at once: the same
    arithmetic lane for lane as the AVX2 kernels, so the same numbers."""
    ext = qmm.extension()
    q = normal((1, 8, 45, 128), 11)  # 4 query heads a kv head: 180 rows a head, odd blocks
    k = normal((1, 2, 400, 128), 12)[:, :, :389]
    v = normal((1, 2, 400, 128), 13)[:, :, :389]
    got = {}
    for allowed in (True, False):
        ext.set_avx512(allowed)
        try:
            got[allowed] = ext.prompt_sdpa(q, k, v, [], 1, 0.09)
            mx.eval(got[allowed])
        finally:
            ext.set_avx512(True)
    assert mx.array_equal(got[True], got[False]).item()
    want = mlx_op("scaled_dot_product_attention")(q, k, v, scale=0.09, mask="causal")
    assert relative_error(got[True], want) < TOLERANCE


def test_attention_over_a_long_context_takes_the_prompt_path():
    q, k, v = attention_inputs(step_ops.SDPA_MAX_QUERIES + 1, 3000, seed=6)
    ext = qmm.extension()
    assert hasattr(ext, "prompt_sdpa")
    got = prompt_attention.attention(ext, q, k, v, 0.125, "causal")
    assert got is not None
    want = mlx_op("scaled_dot_product_attention")(q, k, v, scale=0.125, mask="causal")
    assert relative_error(got, want) < TOLERANCE


def test_a_chunk_holds_no_block_of_scores():
    """A chunk's attention holds its output, not a heads x rows x keys block of
    scores (16 MB here, against the output's 0.5 MB)."""
    ext = qmm.extension()
    q = normal((1, 8, 256, 64), 8)
    k, v = normal((1, 2, 2048, 64), 9), normal((1, 2, 2048, 64), 10)
    mx.eval(q, k, v)
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    got = ext.prompt_sdpa(q, k, v, [], 1, 0.125)
    mx.eval(got)
    assert mx.get_peak_memory() - before < 2 * got.nbytes
    want = mlx_op("scaled_dot_product_attention")(q, k, v, scale=0.125, mask="causal")
    assert relative_error(got, want) < TOLERANCE
