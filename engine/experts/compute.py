"""The arithmetic of an offloaded MoE call: mlx-lm's own SwitchGLU, one expert at a time.

The original SwitchGLU stays as a template whose expert tensors are swapped
in for a call; each needed expert runs on the token slots routed to it, so
the output is bit-identical to the resident model's (experts/offload.py
decides which experts and where their tensors come from).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from flashserve.engine.experts.store import SwitchLayout

EMPTY = mx.zeros((0,))


@dataclass
class OffloadLayer:
    layer: int
    layout: SwitchLayout
    template: nn.Module  # the original SwitchGLU, expert tensors swapped in per call
    slots: list[tuple[Any, str, str]] = field(default_factory=list)  # (module, key, tensor name)
    top_k: int = 0
    router: nn.Module | None = None  # this layer's router (resident copy), for prefetch
    next_layer: int | None = None
    slab: dict[str, mx.array] | None = None  # every expert stacked, when all are cached


def per_expert(
    info: OffloadLayer,
    x2: mx.array,
    flat: np.ndarray,
    experts: np.ndarray,
    weights: dict[int, dict[str, mx.array]],
) -> tuple[list[mx.array], list[np.ndarray]]:
    """Run the template once per expert on the token slots routed to it.

    Each expert's tensors go in as a one-expert stack (`w[None]`, a view,
    no copy) with indices all 0, so the arithmetic per slot is the same
    gather_qmm / gather_mm as the resident SwitchGLU's.
    """
    k = flat.shape[-1]
    outs, positions = [], []
    for e in experts:
        rows, cols = np.nonzero(flat == e)
        sub_x = (
            x2
            if len(rows) == x2.shape[0] and (rows == np.arange(len(rows))).all()
            else x2[mx.array(rows.astype(np.uint32))]
        )
        zeros = mx.zeros((len(rows), 1), dtype=mx.uint32)
        out = call_template(info, sub_x, zeros, [int(e)], weights)
        outs.append(out.reshape(len(rows), -1))
        positions.append(rows * k + cols)
    return outs, positions


def call_template(
    info: OffloadLayer,
    x: mx.array,
    remapped: mx.array,
    experts: list[int],
    weights: dict[int, dict[str, mx.array]],
) -> mx.array:
    stacked = {}
    for _, _, name in info.slots:
        parts = [weights[e][name] for e in experts]
        stacked[name] = parts[0][None] if len(parts) == 1 else mx.stack(parts)
    return run_template(info, x, remapped, stacked)


def run_template(
    info: OffloadLayer, x: mx.array, indices: mx.array, tensors: dict[str, mx.array]
) -> mx.array:
    """The original SwitchGLU on `tensors` (stacked experts, by tensor name)."""
    for module, key, name in info.slots:
        module[key] = tensors[name]
    try:
        return info.template(x, indices)
    finally:
        # The lazy graph keeps what it needs; the template must not pin the
        # stacked tensors past this call.
        for module, key, _ in info.slots:
            module[key] = EMPTY


def restore_order(
    outs: list[mx.array], positions: list[np.ndarray], shape: tuple[int, ...]
) -> mx.array:
    """Per-expert outputs back in token-slot order, shaped (*shape, hidden)."""
    order = np.argsort(np.concatenate(positions), kind="stable")
    y = mx.concatenate(outs, axis=0)[mx.array(order.astype(np.uint32))]
    return y.reshape(*shape, y.shape[-1])
