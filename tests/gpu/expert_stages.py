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


def _stages(template: nn.Module, x: mx.array, index: mx.array) -> dict[str, mx.array]:
    """Each stage of mlx-lm's SwitchGLU on x (rows, hidden) routed by index (rows, k)."""
    xe = mx.expand_dims(x, (-2, -3))
    up, gate = template.up_proj(xe, index), template.gate_proj(xe, index)
    act = template.activation(up, gate)
    down = template.down_proj(act, index)
    return {"up": up, "gate": gate, "act": act, "down": down, "out": template(x, index)}


def _one_expert(
    template: nn.Module, x2: mx.array, flat: np.ndarray, e: int, whole: dict[str, mx.array]
) -> dict[str, float]:
    """Expert e's slots run alone, each stage against the whole call's rows of it."""
    rows, cols = np.nonzero(flat == e)
    at = (mx.array(rows.astype(np.uint32)), mx.array(cols.astype(np.uint32)))
    index = mx.full((len(rows), 1), e, dtype=mx.uint32)  # every expert kept: only the batch differs
    got = _stages(template, x2[at[0]], index)
    got["down_same_act"] = template.down_proj(whole["act"][at][:, None], index)
    want = {**whole, "down_same_act": whole["down"]}
    return {k: _largest(v, want[k][at], len(rows)) for k, v in got.items()}


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
            x = mx.random.normal((len(routing), hidden)).astype(dtype)
            flat = np.array(routing)
            # the whole call as the model makes it: one sequence of len(routing) tokens
            ids = mx.array(flat.astype(np.uint32))[None]
            whole = {k: v[0] for k, v in _stages(template, x[None], ids).items()}
            worst: dict[str, float] = {}
            for e in np.unique(flat):
                for k, v in _one_expert(template, x, flat, int(e), whole).items():
                    worst[k] = max(worst.get(k, 0.0), v)
            print(dtype, name, {k: f"{v:.3g}" for k, v in worst.items()}, flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
