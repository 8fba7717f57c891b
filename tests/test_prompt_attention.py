"""Prompt chunks' attention on the CPU (compute/prompt_attention.py, issue 42).

It must agree with MLX's composed attention to float32 rounding for every
mask kind, and give a prompt position the same weights whatever chunk it is
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


def test_a_position_gets_the_same_weights_in_any_chunk():
    """Rows of one prompt position against 100 keys and against 233 (a chunk
    ending later): the weights agree bit for bit, over the keys both have."""
    ext = qmm.extension()
    scores = normal((1, 2, 3, 40, 233), 5) * 4
    for mode, masks in ((1, []), (2, [create_causal_mask(40, 193)])):
        whole = ext.masked_softmax(scores, masks, mode)
        # Rows 0..20 of the chunk ending at key 233 sit at positions 193..213.
        # Cut at position 213: a chunk of 21 rows ending at key 214.
        short_masks = [] if mode == 1 else [create_causal_mask(21, 193)]
        short = ext.masked_softmax(scores[..., :21, :214], short_masks, mode)
        assert mx.array_equal(whole[..., :21, :214], short).item()
        assert (whole[..., :21, 214:] == 0).all().item()


def test_attention_over_a_long_context_takes_the_prompt_path():
    q, k, v = attention_inputs(step_ops.SDPA_MAX_QUERIES + 1, 3000, seed=6)
    ext = qmm.extension()
    assert hasattr(ext, "masked_softmax")
    got = prompt_attention.attention(ext, q, k, v, 0.125, "causal")
    assert got is not None
    want = mlx_op("scaled_dot_product_attention")(q, k, v, scale=0.125, mask="causal")
    assert relative_error(got, want) < TOLERANCE


def test_the_weights_take_the_scores_buffer_when_nothing_else_holds_it():
    """Scores nothing else holds (a chunk's, fresh from the matmul) become the weights in
    place, with the same numbers as scores the caller keeps: a chunk's attention holds
    one heads x rows x keys block, not two."""
    ext = qmm.extension()
    base = normal((1, 2, 4, 256, 512), 6) * 4
    mx.eval(base)
    kept = base + 0.0
    mx.eval(kept)
    expected = ext.masked_softmax(kept, [], 1)  # `kept` is held here: a new block
    mx.eval(expected)
    block = base.nbytes
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    got = ext.masked_softmax(base + 0.0, [], 1)  # the sum is held by nothing else
    mx.eval(got)
    assert mx.get_peak_memory() - before < 1.5 * block  # one block: the sum, then the weights
    assert mx.array_equal(got, expected).item()
