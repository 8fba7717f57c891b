"""A decode step's small ops as one CPU op each (engine/compute/step_ops.py, csrc/step_ops.cpp).

Each op is compared with MLX's own function (its composed CPU fallback) on
the shapes and options mlx-lm's models use; then real architectures built
from their mlx-lm classes decode with the ops on and off, and their decode
graphs are checked to hold the single ops (not the fallbacks' nodes).

Tolerance: 2e-5 of the largest magnitude, as for the quantized matmul. RoPE
at large positions is compared at 1e-4: an angle of ~1000 radians carries
float32's rounding of the angle itself (MLX's exp and ours differ by an ulp).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from flashserve.engine.compute import qmm, step_ops
from flashserve.engine.weights.sources import load_plain
from flashserve.engine.weights.synthetic import make_model_dir

TOLERANCE = 2e-5


@pytest.fixture(autouse=True)
def fast_path():
    assert qmm.select("fast") == "fast"  # this machine has the kernel: CI builds it
    step_ops.install()
    yield
    step_ops.set_enabled(True)
    qmm.select("auto")


def mlx_op(name: str):
    """MLX's own function, as it was before install()."""
    return step_ops._state.original[name]


def relative_error(got: mx.array, want: mx.array) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype
    return (mx.abs(got - want).max() / mx.maximum(mx.abs(want).max(), 1e-30)).item()


def normal(shape: tuple[int, ...], seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed))


def test_rms_norm_matches_mlx_on_contiguous_strided_and_offset_weights():
    w = normal((96,), 1)
    for x in (
        normal((3, 5, 96), 2),
        normal((2, 96, 4), 3).transpose(0, 2, 1),  # a strided view
        normal((96,), 4),
        normal((1, 1, 96), 5) * 1e3,
    ):
        for weight in (w, 1.0 + w):  # Gemma passes 1 + weight
            got = mx.fast.rms_norm(x, weight, 1e-6)
            assert relative_error(got, mlx_op("rms_norm")(x, weight, 1e-6)) < TOLERANCE
        # Gated delta-net normalizes without a weight.
        got = mx.fast.rms_norm(x, None, 1e-6)
        assert relative_error(got, mlx_op("rms_norm")(x, None, 1e-6)) < TOLERANCE


@pytest.mark.parametrize("traditional", [False, True])
def test_rope_matches_mlx_for_every_offset_kind_dims_and_layout(traditional):
    # (B, L, H, D) transposed to (B, H, L, D), as attention hands it over.
    x = normal((2, 7, 5, 64), 6).transpose(0, 2, 1, 3)
    for dims in (64, 32, 16):
        for offset in (0, 9, mx.array(3), mx.array([4, 40])):
            kwargs = {"traditional": traditional, "base": 10000.0, "scale": 1.0, "offset": offset}
            got = mx.fast.rope(x, dims, **kwargs)
            assert relative_error(got, mlx_op("rope")(x, dims, **kwargs)) < TOLERANCE
    freqs = mx.random.uniform(1.0, 500.0, (32,), key=mx.random.key(7))
    kwargs = {"traditional": traditional, "base": None, "scale": 0.5, "offset": 11, "freqs": freqs}
    got = mx.fast.rope(x, 64, **kwargs)
    assert relative_error(got, mlx_op("rope")(x, 64, **kwargs)) < TOLERANCE
    x3 = normal((2, 6, 32), 8)  # (B, L, D): one head
    kwargs = {"traditional": traditional, "base": 500000.0, "scale": 1.0, "offset": 1000}
    got = mx.fast.rope(x3, 32, **kwargs)
    assert relative_error(got, mlx_op("rope")(x3, 32, **kwargs)) < 1e-4


def attention_inputs(
    lq: int, lk: int, seed: int, dim: int = 32
) -> tuple[mx.array, mx.array, mx.array]:
    q = normal((2, 8, lq, dim), seed)
    # Keys and values as a KV cache hands them over: a slice of a longer buffer.
    k = normal((2, 2, lk + 16, dim), seed + 1)[:, :, :lk]
    v = normal((2, 2, lk + 16, dim), seed + 2)[:, :, :lk]
    return q, k, v


@pytest.mark.parametrize("lq", [1, 3, step_ops.SDPA_MAX_QUERIES])
def test_attention_matches_mlx_with_every_mask_kind(lq):
    for lk in (lq, 1 if lq == 1 else lq + 1, 37):
        q, k, v = attention_inputs(lq, lk, seed=lq * 100 + lk)
        masks = [
            None,
            "causal",
            mx.random.uniform(shape=(2, 1, lq, lk), key=mx.random.key(1)) > 0.3,  # left padding
            mx.random.uniform(shape=(2, 8, lq, lk), key=mx.random.key(2)) > 0.5,
            normal((lq, lk), 3),  # additive, broadcast over batch and heads
        ]
        for mask in masks:
            got = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
            want = mlx_op("scaled_dot_product_attention")(q, k, v, scale=0.2, mask=mask)
            assert relative_error(got, want) < TOLERANCE, (lk, mask)


def on_one_thread(compute: Callable[[], mx.array]) -> mx.array:
    """`compute()` evaluated with the kernel's pool off: every part on the calling thread."""
    qmm.set_threads(1)
    try:
        out = compute()
        mx.eval(out)
    finally:
        qmm.set_threads(0)
    return out


@pytest.mark.parametrize(("lq", "dim"), [(1, 32), (4, 64), (1, 128), (2, 72)])
def test_long_context_attention_in_key_chunks_matches_mlx_on_any_thread_count(lq, dim):
    """Past 256 keys attention runs in key chunks, spread over the kernel's threads.

    Head sizes: 64 and 128 take the blocked value sums, 32 and 72 the others.
    """
    lk = 1100  # five chunks, the last one partial (and not a multiple of 8)
    q, k, v = attention_inputs(lq, lk, seed=lq, dim=dim)
    # Padding masks out a sequence's first 600 keys: whole chunks are masked.
    padding = mx.arange(lk)[None, None, None, :] >= mx.array([0, 600]).reshape(2, 1, 1, 1)
    minus_inf = mx.where(mx.arange(lk) < 300, -mx.inf, 0.0).reshape(1, 1, 1, lk)
    sdpa = mx.fast.scaled_dot_product_attention
    for mask in (None, "causal", padding, minus_inf):
        want = mlx_op("scaled_dot_product_attention")(q, k, v, scale=0.2, mask=mask)
        got = sdpa(q, k, v, scale=0.2, mask=mask)
        assert relative_error(got, want) < TOLERANCE, mask
        alone = on_one_thread(lambda mask=mask: sdpa(q, k, v, scale=0.2, mask=mask))
        assert mx.array_equal(alone, got).item()
        # A sequence's rows are the same alone as in the batch.
        own = mask[1:] if isinstance(mask, mx.array) and mask.shape[0] == 2 else mask
        one = sdpa(q[1:], k[1:], v[1:], scale=0.2, mask=own)
        assert mx.array_equal(one, got[1:]).item()


def test_a_decode_batch_at_a_short_context_is_spread_over_threads_to_the_bit():
    """Four sequences of 40 keys (480 key rows) go to the pool: same bits as one thread."""
    q = normal((4, 9, 1, 64), 5)
    k, v = normal((4, 3, 64, 64), 6), normal((4, 3, 64, 64), 7)
    keep = mx.arange(64)[None, None, None, :] < mx.array([40, 40, 31, 12]).reshape(4, 1, 1, 1)
    sdpa = mx.fast.scaled_dot_product_attention
    spread = sdpa(q, k, v, scale=0.125, mask=keep)
    alone = on_one_thread(lambda: sdpa(q, k, v, scale=0.125, mask=keep))
    assert mx.array_equal(alone, spread).item()
    want = mlx_op("scaled_dot_product_attention")(q, k, v, scale=0.125, mask=keep)
    assert relative_error(spread, want) < TOLERANCE


@pytest.mark.parametrize("lk", [300, 1100])
def test_a_left_padded_sequence_attends_as_it_does_alone(lk):
    """A batch left-pads its shorter sequences (mlx-lm's BatchKVCache): same bits as alone."""
    pad = 517  # shifts the keys across chunk and block boundaries
    q, k, v = attention_inputs(1, lk + pad, seed=9, dim=64)
    keep = mx.arange(lk + pad)[None, None, None, :] >= mx.array([0, pad]).reshape(2, 1, 1, 1)
    batch = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=keep)
    alone = mx.fast.scaled_dot_product_attention(q[1:], k[1:, :, pad:], v[1:, :, pad:], scale=0.2)
    assert mx.array_equal(alone, batch[1:]).item()


@pytest.mark.parametrize("lk", [5, 300, 1100])
def test_keys_past_the_last_one_a_bool_mask_admits_are_left_out_to_the_bit(lk):
    """A fixed-capacity buffer (the compiled decode step's) attends as one of exact length.

    Its unused tail is masked for every row; the result must be the same bits
    as attention over only the keys written, in a batch with left padding.
    """
    tail = 211  # unused rows: moves where the chunks would end
    q, k, v = attention_inputs(1, lk + tail, seed=4, dim=64)
    positions = mx.arange(lk + tail)[None, None, None, :]
    pad = mx.array([0, lk // 2]).reshape(2, 1, 1, 1)
    buffer = (positions >= pad) & (positions < lk)
    exact = positions[..., :lk] >= pad
    sdpa = mx.fast.scaled_dot_product_attention
    got = sdpa(q, k, v, scale=0.2, mask=buffer)
    want = sdpa(q, k[:, :, :lk], v[:, :, :lk], scale=0.2, mask=exact)
    assert mx.array_equal(got, want).item()
    # A mask that hides every key keeps them all, as MLX's does (every value averaged).
    hidden = mx.zeros((1, 1, 1, lk + tail), dtype=mx.bool_)
    everything = mlx_op("scaled_dot_product_attention")(q, k, v, scale=0.2, mask=hidden)
    assert relative_error(sdpa(q, k, v, scale=0.2, mask=hidden), everything) < TOLERANCE


def test_logsumexp_matches_mlx_on_the_vocabulary_and_special_values():
    rows = [
        normal((1, 49152), 20) * 10,  # the default model's vocabulary
        normal((4, 1000), 21),
        normal((2, 96, 3), 22).transpose(0, 2, 1),  # strided
        normal((13,), 23),  # shorter than one vector
        mx.array([[-float("inf")] * 5, [1.0, float("inf"), 0, 0, 0], [1.0, float("nan"), 0, 0, 0]]),
    ]
    for x in rows:
        for keepdims in (True, False):
            got = mx.logsumexp(x, axis=-1, keepdims=keepdims)
            want = mlx_op("logsumexp")(x, axis=-1, keepdims=keepdims)
            assert got.shape == want.shape
            assert mx.allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=True).item()
    # Other axes, and every axis at once, are MLX's.
    x = normal((3, 5), 24)
    for axis in (0, None, (0, 1)):
        assert mx.array_equal(mx.logsumexp(x, axis=axis), mlx_op("logsumexp")(x, axis=axis)).item()


def test_swiglu_matches_mlx_lm_including_saturated_gates():
    gate = normal((4, 205), 30) * 4
    gate[0, :5] = mx.array([-200.0, -88.0, 0.0, 88.0, 200.0])  # e^-g under- and overflows
    x = normal(gate.shape, 31)
    got = step_ops.swiglu(gate, x)
    want = mlx_op("swiglu")(gate, x)
    assert relative_error(got, want) < TOLERANCE
    strided = normal((gate.shape[1], 4), 32).T  # a transposed view
    assert relative_error(step_ops.swiglu(strided, x), mlx_op("swiglu")(strided, x)) < TOLERANCE


def test_calls_the_fast_ops_do_not_take_go_to_mlx_unchanged(tmp_path: Path):
    q, k, v = attention_inputs(step_ops.SDPA_MAX_QUERIES + 1, 20, seed=9)
    sdpa, sdpa_mlx = mx.fast.scaled_dot_product_attention, mlx_op("scaled_dot_product_attention")
    # A prompt chunk (more query rows) takes compute/prompt_attention.py: MLX's
    # numbers to float32 rounding (tests/test_prompt_attention.py); float16
    # keeps MLX's op, bit for bit.
    got = sdpa(q, k, v, scale=0.3, mask="causal")
    assert relative_error(got, sdpa_mlx(q, k, v, scale=0.3, mask="causal")) < TOLERANCE
    q16, k16, v16 = (a.astype(mx.float16) for a in attention_inputs(1, 5, seed=10))
    got = sdpa(q16, k16, v16, scale=0.3)
    assert mx.array_equal(got, sdpa_mlx(q16, k16, v16, scale=0.3)).item()
    x, w = normal((2, 64), 11), normal((64,), 12)
    # The fast path off (the bench's MLX rows, `quantized_matmul = "mlx"`) or
    # the layer ops alone turned off: MLX's ops, bit for bit.
    for off in (lambda: qmm.set_active(False), lambda: step_ops.set_enabled(False)):
        off()
        assert mx.array_equal(mx.fast.rms_norm(x, w, 1e-5), mlx_op("rms_norm")(x, w, 1e-5)).item()
        q, k, v = attention_inputs(1, 9, seed=13)
        got = sdpa(q, k, v, scale=0.3)
        assert mx.array_equal(got, sdpa_mlx(q, k, v, scale=0.3)).item()
        qmm.set_active(True)
        step_ops.set_enabled(True)
    assert graph_ops(mx.fast.rms_norm(x, w, 1e-5), path=tmp_path / "on.dot") == {
        "FlashserveRMSNorm": 1
    }


def graph_ops(*outputs: mx.array, path: Path) -> Counter:
    """The primitives in the graph of `outputs` (MLX's dot export), by name."""
    mx.export_to_dot(str(path), *outputs)
    return Counter(re.findall(r'label ="([A-Za-z]+)', path.read_text()))


# Nodes at least that each fast op replaces (MLX's fallback, less a few
# that the model's own code may share with it).
REPLACED_NODES = {"FlashserveRMSNorm": 10, "FlashserveRoPE": 20, "FlashserveSDPA": 10}

ARCHS = {
    "llama": {},
    # Llama 3's RoPE scaling passes explicit frequencies.
    "llama+rope_scaling": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "qwen3": {},  # RMSNorm on q and k per head
    "gemma3_text": {},  # 1 + weight norms, sliding and global layers
    "qwen3_next": {},  # partial rotary dims, recurrent layers beside attention
}


@pytest.mark.usefixtures("float_decode_x")  # the ops against MLX's, not x's rounding
@pytest.mark.parametrize("name", list(ARCHS))
def test_real_architectures_decode_the_same_with_one_node_per_op(name, tmp_path: Path):
    arch = name.split("+")[0]
    path = make_model_dir(
        tmp_path / name, arch, overrides=ARCHS[name], quantize_bits=4, group_size=32
    )
    model, _, _ = load_plain(path)
    qmm.use_fast_qmm(model)
    step_ops.install()  # the model's module imported just now: its swiglu too
    prompt = mx.array([[5, 9, 13, 2, 7, 11, 3]])

    def decode(enabled: bool, steps: int = 6) -> tuple[list[mx.array], Counter]:
        step_ops.set_enabled(enabled)
        cache = make_prompt_cache(model)
        logits = model(prompt, cache=cache)[:, -1]
        out, ops = [logits], Counter()
        for _ in range(steps):
            token = mx.argmax(out[-1], axis=-1)[:, None]
            mx.eval(token)
            step = model(token, cache=cache)[:, -1]
            if not ops:
                ops = graph_ops(step, path=tmp_path / "step.dot")
            out.append(step)
        mx.eval(out)
        return out, ops

    fast, fast_ops = decode(True)
    plain, plain_ops = decode(False)
    for got, want in zip(fast, plain, strict=True):
        assert relative_error(got, want) < 1e-4
    assert [mx.argmax(x).item() for x in fast] == [mx.argmax(x).item() for x in plain]
    attention_layers = sum(1 for n, _ in model.named_modules() if n.endswith(".self_attn"))
    assert attention_layers > 0
    assert fast_ops["FlashserveSDPA"] == attention_layers
    assert fast_ops["FlashserveRoPE"] == 2 * attention_layers  # queries and keys
    # RMSNorms and SwiGLUs that feed a quantized matmul are computed by it
    # (graph_folds: no node of their own); the others are one node each.
    norms = plain_ops["Rsqrt"] - fast_ops["Rsqrt"]  # MLX's fallback: one Rsqrt each
    assert norms >= 2 * model.args.num_hidden_layers
    assert 0 <= fast_ops["FlashserveRMSNorm"] < norms  # some folded: the one before the head
    # Every SwiGLU (mlx-lm's compiled sigmoid-multiply kernel) became ours;
    # Gemma's GeGLU and gated attention's sigmoids stay MLX's.
    sigmoids = [sum(n for op, n in ops.items() if "Sigmoid" in op) for ops in (plain_ops, fast_ops)]
    swiglus = sigmoids[0] - sigmoids[1]
    assert swiglus >= fast_ops["FlashserveSwiGLU"]
    assert arch == "gemma3_text" or swiglus >= model.args.num_hidden_layers
    assert "Cos" not in fast_ops and "Sin" not in fast_ops
    assert fast_ops["Softmax"] == plain_ops["Softmax"] - attention_layers
    # Views splitting and merging heads (4 transposes a layer): the output
    # projection reads the heads, and RoPE reads q and k unless Gemma's
    # per-head norm comes between. The values' stay.
    folded = plain_ops["Transpose"] - fast_ops["Transpose"]
    assert folded >= (1 if arch == "gemma3_text" else 3) * attention_layers
    # MLX's fallbacks are 15, 31 and 18 nodes; each fast op is one.
    saved = sum(plain_ops.values()) - sum(fast_ops.values())
    assert saved >= sum(fast_ops[op] * n for op, n in REPLACED_NODES.items())
