"""Where an offloaded expert's numbers part from the resident call's, op by op (a GPU diagnosis).

    python tests/gpu/expert_stages.py WORK_DIR

Builds the tiny prepared qwen3_moe of the identity tests and runs layer 2's SwitchGLU
over small calls (below 64 slots: unsorted), whole and one expert's slots at a time as
the offload runs them (experts/compute.py: per_expert), in float16 and float32. Prints,
per call, the largest difference of each stage (up, gate, activation, down, the whole
output; "down_same_act": down on the whole call's activation rows). All zeros on the
CPU; on a GPU the first nonzero stage names the op whose kernel depends on the batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx import nn

from flashserve.engine.compute import device
from flashserve.engine.config import EngineConfig
from flashserve.engine.loader import load
from flashserve.engine.weights.prepare import prepare
from flashserve.engine.weights.synthetic import make_model_dir

CALLS = {
    "chunked-test": [[0, 1], [2, 3], [4, 5], [6, 7], [1, 6], [3, 3]],
    "distinct": [[0, 1], [2, 3], [4, 5], [6, 7], [1, 6], [3, 5]],
    "one-per-expert": [[0, 1], [2, 3], [4, 5], [6, 7]],
}


def _largest(a: mx.array, b: mx.array, rows: int) -> float:
    a, b = a.astype(mx.float32).reshape(rows, -1), b.astype(mx.float32).reshape(rows, -1)
    return float(mx.max(mx.abs(a - b)).item())


def _one_expert(
    template: nn.Module, x2: mx.array, flat: np.ndarray, e: int, whole: dict[str, mx.array]
) -> dict[str, float]:
    """Expert e's slots run alone, each stage against the whole call's rows of it."""
    rows, cols = np.nonzero(flat == e)
    at = (mx.array(rows.astype(np.uint32)), mx.array(cols.astype(np.uint32)))
    sx = mx.expand_dims(x2[at[0]], (-2, -3))
    index = mx.full((len(rows), 1), e, dtype=mx.uint32)  # every expert kept: only the batch differs
    up, gate = template.up_proj(sx, index), template.gate_proj(sx, index)
    act = template.activation(up, gate)
    got = {
        "up": up,
        "gate": gate,
        "act": act,
        "down": template.down_proj(act, index),
        "down_same_act": template.down_proj(whole["act"][0][at][:, None], index),
        "out": template(x2[at[0]], index),
    }
    want = {**whole, "down_same_act": whole["down"]}
    return {k: _largest(v, want[k][0][at], len(rows)) for k, v in got.items()}


def main(work: Path) -> None:
    device.select("auto")
    print("device", mx.default_device())
    work.mkdir(parents=True, exist_ok=True)
    src = make_model_dir(work / "src", "qwen3_moe")
    path = prepare(str(src), work / "prepared", expert_bits=4, force=True)
    loaded = load(EngineConfig(model=str(path)))
    template, hidden = loaded.model.layers[2].mlp.switch_mlp, loaded.config["hidden_size"]
    mx.random.seed(0)
    for dtype in (mx.float16, mx.float32):
        for name, routing in CALLS.items():
            x = mx.random.normal((1, len(routing), hidden)).astype(dtype)
            ids = mx.array(np.array([routing], np.uint32))
            xe = mx.expand_dims(x, (-2, -3))
            up, gate = template.up_proj(xe, ids), template.gate_proj(xe, ids)
            act = template.activation(up, gate)
            whole = {
                "up": up,
                "gate": gate,
                "act": act,
                "down": template.down_proj(act, ids),
                "out": template(x, ids),
            }
            flat = np.array(routing)
            worst: dict[str, float] = {}
            for e in np.unique(flat):
                for k, v in _one_expert(
                    template, x.reshape(-1, hidden), flat, int(e), whole
                ).items():
                    worst[k] = max(worst.get(k, 0.0), v)
            print(dtype, name, {k: f"{v:.3g}" for k, v in worst.items()}, flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
