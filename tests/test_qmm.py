"""flashserve's CPU quantized matmul (engine/compute/qmm.py, csrc/) against MLX's kernel.

Tolerance: the largest difference from `mx.quantized_matmul` is at most 2e-5
of the largest output magnitude (float32 rounding of sums in another order;
observed ~1.5e-6). Where the kernel promises exact equality (a row alone or in
a batch, any thread count, offloaded vs resident experts) the tests compare
bit for bit.
"""

from __future__ import annotations

import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

from flashserve.engine import compute
from flashserve.engine.compute import qmm
from flashserve.engine.compute.half_scales import Float32QuantizedEmbedding
from flashserve.engine.compute.prompt_matmul import PromptQuantizedLinear

from .conftest import start_server, stop_server

TOLERANCE = 2e-5


@pytest.fixture(autouse=True)
def fast_path():
    assert qmm.select("fast") == "fast"  # this machine has the kernel: CI builds it
    # The float kernels against MLX's: a model loaded earlier set decode_matmul (int16
    # by default, tests/test_qmm_int.py), which rounds x.
    x_bits = qmm.extension().x_bits()
    qmm.set_decode_matmul("float")
    yield
    qmm.extension().set_x_bits(x_bits)
    qmm.select("auto")


def relative_error(got: mx.array, want: mx.array) -> float:
    return (mx.abs(got - want).max() / mx.maximum(mx.abs(want).max(), 1e-30)).item()


def weights(n: int, k: int, bits: int, group_size: int, dtype: mx.Dtype, seed: int = 0):
    w = mx.random.normal((n, k), key=mx.random.key(seed))
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    return wq, scales.astype(dtype), biases.astype(dtype)


@pytest.mark.parametrize("bits", qmm.BITS)
def test_every_width_group_and_scale_dtype_matches_mlx(bits):
    k = 384  # a multiple of every group size, 3 groups of 128
    for group_size in qmm.GROUP_SIZES:
        for dtype in (mx.float32, mx.float16, mx.bfloat16):
            wq, scales, biases = weights(37, k, bits, group_size, dtype, seed=bits)
            for rows in (1, 2, 3, 4, 5, 7, 8, 13):
                x = mx.random.normal((rows, k), key=mx.random.key(rows))
                got = qmm.quantized_matmul(x, wq, scales, biases, group_size, bits)
                want = mx.quantized_matmul(
                    x, wq, scales, biases, transpose=True, group_size=group_size, bits=bits
                )
                assert got.shape == want.shape == (rows, 37)
                err = relative_error(got, want)
                assert err < TOLERANCE, (bits, group_size, dtype, rows, err)


@pytest.mark.parametrize("bits", [4, 8])
def test_avx512_and_avx2_kernels_both_match_mlx(bits):
    """4 and 8 bits have two kernels: K not a multiple of the AVX-512 chunk (128) included,
    its last chunk 32, 64 or 96 values."""
    if not qmm.set_avx512(True):
        pytest.skip("this CPU has no AVX-512")
    try:
        for avx512 in (True, False):
            assert qmm.set_avx512(avx512) == avx512
            for k in (576, 320, 1536, 160, 224):
                for group_size in (g for g in qmm.GROUP_SIZES if k % g == 0):
                    for dtype in (mx.float32, mx.float16, mx.bfloat16):
                        wq, scales, biases = weights(21, k, bits, group_size, dtype, seed=k)
                        for rows in (1, 2, 3, 4, 6, 9):
                            x = mx.random.normal((rows, k), key=mx.random.key(rows))
                            got = qmm.quantized_matmul(x, wq, scales, biases, group_size, bits)
                            want = mx.quantized_matmul(
                                x,
                                wq,
                                scales,
                                biases,
                                transpose=True,
                                group_size=group_size,
                                bits=bits,
                            )
                            err = relative_error(got, want)
                            assert err < TOLERANCE, (avx512, k, group_size, dtype, rows, err)
    finally:
        qmm.set_avx512(True)


class Block(nn.Module):
    """An attention block's projections and an MLP's, named as mlx-lm names them."""

    def __init__(self, dims: int = 256, hidden: int = 384):
        super().__init__()
        self.q_proj = nn.Linear(dims, dims, bias=True)
        self.k_proj = nn.Linear(dims, 64, bias=False)
        self.v_proj = nn.Linear(dims, 64, bias=False)
        self.gate_proj = nn.Linear(dims, hidden, bias=False)
        self.up_proj = nn.Linear(dims, hidden, bias=False)


def test_sibling_linears_share_one_op_and_give_the_same_bits():
    block = Block()
    nn.quantize(block, group_size=32, bits=4)
    block.up_proj = nn.QuantizedLinear.from_linear(nn.Linear(256, 384), group_size=64, bits=8)
    assert qmm.use_fast_qmm(block) == 5
    attention = block.q_proj._qmm_siblings
    assert attention.members == [block.q_proj, block.k_proj, block.v_proj]
    assert block.gate_proj._qmm_siblings.members == [block.gate_proj, block.up_proj]
    x = mx.random.normal((3, 1, 256), key=mx.random.key(12))
    other = mx.random.normal((3, 1, 256), key=mx.random.key(13))
    names = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
    qmm.set_fusion(False)
    try:
        alone = {n: getattr(block, n)(x) for n in names}
        alone_other = block.k_proj(other)
    finally:
        qmm.set_fusion(True)
    # Any order; a member called with another input (or twice) computes afresh.
    for order in (names, names[::-1]):
        got = {n: getattr(block, n)(x) for n in order}
        for n in names:
            assert mx.array_equal(got[n], alone[n]).item(), n
        assert attention.x is None and not attention.kept  # nothing held once all are taken
    block.q_proj(x)
    assert mx.array_equal(block.k_proj(other), alone_other).item()
    assert mx.array_equal(block.k_proj(x), alone["k_proj"]).item()
    assert mx.array_equal(block.v_proj(x), alone["v_proj"]).item()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (8, 64), (3, 64), (6, 32)])
def test_quantized_linear_with_and_without_bias(bias, bits, group_size):
    linear = nn.Linear(320, 75, bias=bias)  # odd output width
    plain = nn.QuantizedLinear.from_linear(linear, group_size=group_size, bits=bits)
    want = [plain(x) for x in inputs()]
    assert qmm.use_fast_qmm(plain) == 1
    assert type(plain) is qmm.FastQuantizedLinear
    for x, w in zip(inputs(), want, strict=True):
        assert relative_error(plain(x), w) < TOLERANCE


def inputs() -> list[mx.array]:
    """Decode-shaped inputs: one row, a batch of 8 tokens, 2-D rows, a strided view."""
    key = mx.random.key(3)
    wide = mx.random.normal((6, 640), key=key)
    return [
        mx.random.normal((1, 1, 320), key=key),
        mx.random.normal((8, 1, 320), key=key),
        mx.random.normal((5, 320), key=key),
        wide[:, ::2],  # not contiguous: copied inside the primitive
        mx.broadcast_to(mx.random.normal((1, 320), key=key), (4, 320)),
    ]


@pytest.mark.parametrize("bits, k", [(4, 576), (4, 160), (8, 576)])
def test_a_row_gives_the_same_bits_alone_in_a_batch_and_on_any_thread_count(bits, k):
    """One row and tiles of 2-4 rows take different code for a short last chunk (K = 576, 160)."""
    wq, scales, biases = weights(1536, k, bits, 32, mx.float16)
    batch = mx.random.normal((8, k), key=mx.random.key(4))
    together = qmm.quantized_matmul(batch, wq, scales, biases, 32, bits)
    for row in range(8):
        alone = qmm.quantized_matmul(batch[row : row + 1], wq, scales, biases, 32, bits)
        assert mx.array_equal(alone[0], together[row]).item()
    try:
        qmm.set_threads(1)
        single = qmm.quantized_matmul(batch, wq, scales, biases, 32, bits)
    finally:
        qmm.set_threads(0)
    assert mx.array_equal(single, together).item()


def test_tied_embedding_head_and_prompt_linear_keep_their_own_behaviour():
    embedding = nn.Embedding(300, 256)
    q = nn.QuantizedEmbedding.from_embedding(embedding, group_size=32, bits=8)
    q.update({"scales": q["scales"].astype(mx.float16), "biases": q["biases"].astype(mx.float16)})
    q.__class__ = Float32QuantizedEmbedding
    tokens = mx.array([[1, 7, 299]])
    looked_up = q(tokens)
    x = mx.random.normal((3, 1, 256), key=mx.random.key(5))
    want = q.as_linear(x)
    assert qmm.use_fast_qmm(q) == 1
    assert isinstance(q, Float32QuantizedEmbedding) and isinstance(q, qmm.FastQuantizedEmbedding)
    assert mx.array_equal(q(tokens), looked_up).item()  # lookups unchanged
    assert relative_error(q.as_linear(x), want) < TOLERANCE

    linear = nn.QuantizedLinear.from_linear(nn.Linear(256, 64), group_size=32, bits=4)
    linear.__class__ = PromptQuantizedLinear
    prompt = mx.random.normal((2, 9, 256), key=mx.random.key(6))
    via_blas = linear(prompt)
    assert qmm.use_fast_qmm(linear) == 1
    # Prompt chunks still take dequantize + BLAS, bit for bit; decode rows the kernel.
    assert mx.array_equal(linear(prompt), via_blas).item()
    step = prompt[:, :1]
    kernel = (
        qmm.quantized_matmul(step, linear["weight"], linear["scales"], linear["biases"], 32, 4)
        + linear["bias"]
    )
    assert mx.array_equal(linear(step), kernel).item()


def switch_glu(bits: int) -> SwitchGLU:
    glu = SwitchGLU(256, 128, 6, bias=False)
    nn.quantize(
        glu, group_size=64, bits=bits, class_predicate=lambda _, m: hasattr(m, "to_quantized")
    )
    assert type(glu.gate_proj) is QuantizedSwitchLinear
    return glu


@pytest.mark.parametrize("bits", [4, 8])
def test_expert_matmuls_match_gather_qmm_and_one_expert_at_a_time(bits):
    glu = switch_glu(bits)
    x = mx.random.normal((3, 5, 256), key=mx.random.key(7))
    # 30 slots: SwitchGLU sorts them (sorted_indices) past 64; 3 x 5 x 2 stays unsorted.
    indices = mx.random.randint(0, 6, (3, 5, 2), key=mx.random.key(8)).astype(mx.uint32)
    want = glu(x, indices)
    many = mx.random.normal((40, 1, 256), key=mx.random.key(9))
    many_idx = mx.random.randint(0, 6, (40, 1, 2), key=mx.random.key(10)).astype(mx.uint32)
    want_sorted = glu(many, many_idx)
    assert qmm.use_fast_qmm(glu) == 3
    got = glu(x, indices)
    assert relative_error(got, want) < TOLERANCE
    assert relative_error(glu(many, many_idx), want_sorted) < TOLERANCE

    # The expert cache runs one expert at a time on a one-expert stack (w[None],
    # indices 0): the same rows must come out bit for bit.
    flat_x = x.reshape(-1, 256)
    flat_idx = indices.reshape(-1, 2)
    for expert in range(6):
        rows, cols = [], []
        for r in range(flat_idx.shape[0]):
            for c in range(2):
                if flat_idx[r, c].item() == expert:
                    rows.append(r)
                    cols.append(c)
        if not rows:
            continue
        one = SwitchGLU(256, 128, 1, bias=False)
        nn.quantize(
            one, group_size=64, bits=bits, class_predicate=lambda _, m: hasattr(m, "to_quantized")
        )
        for name in ("gate_proj", "up_proj", "down_proj"):
            source, target = getattr(glu, name), getattr(one, name)
            for key in ("weight", "scales", "biases"):
                target[key] = source[key][expert][None]
        qmm.use_fast_qmm(one)
        sub = flat_x[mx.array(rows)]
        out = one(sub, mx.zeros((len(rows), 1), dtype=mx.uint32)).reshape(len(rows), -1)
        full = got.reshape(-1, 2, 256)[mx.array(rows), mx.array(cols)]
        assert mx.array_equal(out, full).item()


@pytest.mark.parametrize("bits", [4, 8])
def test_a_list_of_expert_weights_gives_the_bits_of_the_stacked_gather(bits):
    """gather_qmm_list (the expert cache's experts where they lie) == gather_qmm on a stack."""
    w, scales, biases = weights(6 * 96, 256, bits, 64, mx.float16, seed=3)
    w, scales, biases = (a.reshape(6, 96, -1) for a in (w, scales, biases))
    x = mx.random.normal((10, 256), key=mx.random.key(4))
    idx = mx.random.randint(0, 6, (10,), key=mx.random.key(5)).astype(mx.uint32)
    ext = qmm.extension()
    want = ext.gather_qmm(x, w, scales, biases, idx, 64, bits)
    # Only experts 1, 3 and 4, in another order: rows index the list.
    subset = [4, 1, 3]
    rows = mx.array([r for r in range(10) if idx[r].item() in subset])
    lut = {e: i for i, e in enumerate(subset)}
    remapped = mx.array([lut[idx[r].item()] for r in rows.tolist()], dtype=mx.uint32)
    lists = ([w[e] for e in subset], [scales[e] for e in subset], [biases[e] for e in subset])
    # Unevaluated views go in as graph inputs; evaluated ones (the cache's) the op holds.
    lazy = ext.gather_qmm_list(x[rows], *lists, remapped, 64, bits)
    mx.eval(lists)
    held = ext.gather_qmm_list(x[rows], *lists, remapped, 64, bits)
    assert mx.array_equal(lazy, want[rows]).item()
    assert mx.array_equal(held, want[rows]).item()
    with pytest.raises(ValueError, match="experts differ in shape"):
        ext.gather_qmm_list(
            x,
            [w[0], w[1][:48]],
            [scales[0], scales[1][:48]],
            [biases[0], biases[1][:48]],
            idx % 2,
            64,
            bits,
        )


def test_choices_and_switching_off():
    with pytest.raises(qmm.QmmError, match="choose one of auto, fast, mlx"):
        qmm.select("bogus")
    plain = nn.QuantizedLinear.from_linear(nn.Linear(128, 32), group_size=32, bits=4)
    x = mx.random.normal((1, 128), key=mx.random.key(11))
    want, want_half = plain(x), plain(x.astype(mx.float16))
    assert qmm.select("mlx") == "mlx" and not qmm.active()
    assert qmm.use_fast_qmm(plain) == 0  # MLX's kernel chosen: nothing switched
    assert type(plain) is nn.QuantizedLinear
    assert qmm.select("auto") == "fast" and qmm.active()
    assert qmm.use_fast_qmm(plain) == 1
    assert qmm.use_fast_qmm(plain) == 0  # already switched
    qmm.set_active(False)  # the bench's switch: MLX's kernel again, bit for bit
    assert mx.array_equal(plain(x), want).item()
    qmm.set_active(True)
    assert relative_error(plain(x), want) < TOLERANCE
    # float16 inputs keep MLX's kernel.
    assert mx.array_equal(plain(x.astype(mx.float16)), want_half).item()


def test_without_the_built_kernel_auto_falls_back_and_fast_refuses(monkeypatch, caplog):
    monkeypatch.setattr(qmm, "_state", qmm._State())
    monkeypatch.setitem(sys.modules, "flashserve.engine.compute._qmm", None)  # import fails
    monkeypatch.delattr(compute, "_qmm", raising=False)
    with caplog.at_level(logging.INFO, logger=qmm.__name__):
        assert qmm.select("auto") == "mlx"
    assert [r.getMessage() for r in caplog.records] == [
        "quantized matmuls use MLX's kernel: the kernel was not built at install time "
        "(import of flashserve.engine.compute._qmm halted; None in sys.modules)"
    ]
    plain = nn.QuantizedLinear.from_linear(nn.Linear(64, 32), group_size=32, bits=4)
    assert qmm.use_fast_qmm(plain) == 0
    with pytest.raises(qmm.QmmError, match="'fast' cannot run here: the kernel was not built"):
        qmm.select("fast")


def test_unsupported_shapes_raise_instead_of_computing_garbage():
    wq, scales, biases = weights(16, 96, 4, 32, mx.float32)
    with pytest.raises(ValueError, match="w does not match"):
        qmm.quantized_matmul(mx.ones((1, 64)), wq, scales, biases, 32, 4)
    with pytest.raises(ValueError, match="unsupported bits or group size"):
        qmm.quantized_matmul(mx.ones((1, 96)), wq, scales, biases, 16, 4)
    with pytest.raises(ValueError, match="x must be float32"):
        qmm.quantized_matmul(mx.ones((1, 96), dtype=mx.float16), wq, scales, biases, 32, 4)


PROMPTS = ["What is the capital of France?", "List three prime numbers."]


def greedy(server, prompt: str) -> str:
    response = server.client().chat.completions.create(
        model=server.model_id,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=20,
    )
    return response.choices[0].message.content


def test_server_gives_the_same_greedy_text_on_both_kernels(tmp_path: Path):
    """The default model on the fast path and on MLX's kernel; batched and alone."""
    texts = {}
    for choice in ("fast", "mlx"):
        (tmp_path / choice).mkdir()
        server = start_server(None, tmp_path / choice, "--quantized-matmul", choice)
        try:
            texts[choice] = [greedy(server, p) for p in PROMPTS]
            if choice == "fast":
                with ThreadPoolExecutor(len(PROMPTS)) as pool:  # decoded in one batch
                    batched = list(pool.map(lambda p, s=server: greedy(s, p), PROMPTS))
                assert batched == texts["fast"]
                assert "flashserve's CPU kernel" in server.log_tail(20000)
            else:
                assert "flashserve's CPU kernel" not in server.log_tail(20000)
        finally:
            stop_server(server)
    assert all(texts["fast"]), texts
    assert "Paris" in texts["fast"][0]
    assert texts["fast"] == texts["mlx"]
