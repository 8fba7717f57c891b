"""The expert-major prefill's ops (csrc/expert_ops.cpp) give the template's numbers (issue 46).

`expert_glu` runs one expert's whole SwitchGLU as one op, and `slot_rows`
puts the experts' outputs back in token-slot order; both must be exactly
what mlx-lm's SwitchGLU and a concatenation plus gather give, since the
offloaded prefill has to stay bit-identical to the resident model.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from flashserve.engine.compute import qmm
from flashserve.engine.config import EngineConfig
from flashserve.engine.experts import compute
from flashserve.engine.loader import load
from flashserve.engine.weights.prepare import prepare
from flashserve.engine.weights.synthetic import make_model_dir

WIDE = {"hidden_size": 256, "intermediate_size": 128, "moe_intermediate_size": 128}

pytestmark = pytest.mark.skipif(
    qmm.unavailable_reason() is not None, reason=f"no fast kernel: {qmm.unavailable_reason()}"
)


def _routing(tokens: int, experts: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)])


@pytest.mark.parametrize(
    ("arch", "bits", "group_size"),
    [("qwen3_moe", 4, 64), ("qwen3_moe", 8, 64), ("qwen3_moe", 4, 32), ("mixtral", 4, 64)],
)
def test_fused_expert_is_the_template_bit_for_bit(
    tmp_path: Path, arch: str, bits: int, group_size: int
) -> None:
    source = make_model_dir(tmp_path / "src", arch, overrides=WIDE)
    prepared = prepare(str(source), tmp_path / "prepared", expert_bits=bits, group_size=group_size)
    loaded = load(EngineConfig(model=str(prepared), expert_cache="3"))
    offload = loaded.experts
    try:
        info = offload.layers[min(offload.layers)]
        # 70 tokens: several experts get 64 slots or more, where the template sorts them.
        x2 = mx.random.normal((70, WIDE["hidden_size"]), key=mx.random.key(3))
        flat = _routing(70, info.layout.num_experts, info.top_k, seed=bits)
        needed = np.unique(flat)
        weights = {int(e): offload.store.read(info.layer, int(e)) for e in needed}
        op = compute.fused_glu(info, x2)
        assert op is not None
        fused, where = compute.per_expert(info, x2, flat, needed, weights, op)
        template, where_t = compute.per_expert(info, x2, flat, needed, weights)
        mx.eval(fused, template)
        assert all(np.array_equal(a, b) for a, b in zip(where, where_t, strict=True))
        for a, b in zip(fused, template, strict=True):
            assert a.shape == b.shape
            assert mx.array_equal(a, b).item()
        assert max(len(w) for w in where) >= 8  # experts with many rows were compared
    finally:
        offload.close()


def test_fused_expert_stays_off_where_mlx_kernel_runs(tmp_path: Path) -> None:
    source = make_model_dir(tmp_path / "src", "qwen3_moe", overrides=WIDE)
    prepared = prepare(str(source), tmp_path / "prepared", expert_bits=4)
    loaded = load(EngineConfig(model=str(prepared), expert_cache="3"))
    try:
        info = loaded.experts.layers[min(loaded.experts.layers)]
        x2 = mx.zeros((4, WIDE["hidden_size"]))
        assert compute.fused_glu(info, x2) is not None
        assert compute.fused_glu(info, x2.astype(mx.float16)) is None
        qmm.set_active(False)
        try:
            assert compute.fused_glu(info, x2) is None
        finally:
            qmm.set_active(True)
    finally:
        loaded.experts.close()


def test_restore_parts_gives_consecutive_runs_of_restore_order() -> None:
    """Each run of tokens in an array of its own, equal to that run of the whole output;
    an expert's positions ascend, as the prefill makes them (np.nonzero's order)."""
    tokens, k, width, experts = 23, 2, 48, 5
    flat = np.random.default_rng(1).integers(0, experts, size=(tokens, k))
    outs, positions = [], []
    for e in range(experts):
        rows, cols = np.nonzero(flat == e)
        outs.append(mx.random.normal((len(rows), width), key=mx.random.key(e)))
        positions.append(rows * k + cols)
    whole = compute.restore_order(outs, positions, (tokens, k))
    parts = compute.restore_parts(outs, positions, k, [8, 1, 14])
    assert [p.shape for p in parts] == [(8, k, width), (1, k, width), (14, k, width)]
    assert mx.array_equal(mx.concatenate(parts), whole).item()


def test_slot_rows_is_concatenate_then_gather() -> None:
    sizes = [5, 1, 9, 3, 6]
    outs = [mx.random.normal((n, 48), key=mx.random.key(n)) for n in sizes]
    k = 2
    where = np.random.default_rng(0).permutation(sum(sizes))
    positions = np.split(where, np.cumsum(sizes)[:-1])
    got = compute.restore_order(outs, positions, (1, sum(sizes) // k, k))
    order = np.argsort(where, kind="stable")
    want = mx.concatenate(outs)[mx.array(order.astype(np.uint32))].reshape(1, -1, k, 48)
    assert got.shape == want.shape
    assert mx.array_equal(got, want).item()
    # A strided output (a transposed view) is read where it lies.
    wide = mx.random.normal((48, 4), key=mx.random.key(1)).T
    ext = qmm.extension()
    got = ext.slot_rows([wide, outs[0]], mx.array(np.arange(9)[::-1].astype(np.uint32)), 9)
    assert mx.array_equal(got, mx.concatenate([wide, outs[0]])[::-1]).item()
    with pytest.raises(ValueError, match="every slot once"):
        ext.slot_rows(outs, mx.array(where.astype(np.uint32)), sum(sizes) + 1)
