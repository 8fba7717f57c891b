"""A prefill's experts on the integer prompt GEMM (issue 57): the expert rows of an
offloaded MoE's expert-major prefill, as a dense model's prompt linears.

experts/prefill.py runs each needed expert once on all of a prompt chunk's
tokens routed to it. On the few-row decode kernel (compute.fused_glu) that
costs as much per row as a decode step, and was most of an offloaded MoE's
time to first token. With the model's `prompt_matmul` setting "int16" or
"int8", each expert's gate and up projections run instead as one call of
csrc/prompt_qgemm.cpp on the record's packed weights (its rows rounded once
per block of 32, no float copy of the weights), then the template's
activation, then the down projection as a second call.

A row's numbers depend on that row alone (the GEMM rounds and sums each row
by itself), and every expert of a call goes this way, cached or read, so a
prompt gets the same tokens at any chunking, prefix-cache hit and expert
cache size. Tokens of a part that the dense linears run as decode
(compute/prompt_matmul.py: `decode_rows`, one token per sequence or a
speculative verification's few) run the float op as their linears do, so a
one-token chunk's rows are the same merged into a layer-major round or alone.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models import switch_layers

from flashserve.engine.compute import prompt_experts, prompt_matmul, qmm
from flashserve.engine.experts.compute import (
    PROJECTIONS,
    GluOp,
    OffloadLayer,
    call_template,
    projection_names,
)


def decode_tokens(tokens_per_sequence: int, parts: list[int] | None) -> np.ndarray | bool:
    """Which tokens of a prefill call run as decode: True (all), False (none), or per
    token of a call merged from `parts` (token counts of one-sequence runs)."""
    limit = prompt_matmul.decode_limit()
    if parts is None:
        return tokens_per_sequence <= limit
    each = np.array(parts) <= limit
    if each.all() or not each.any():
        return bool(each[0])
    return np.repeat(each, parts)


def integer_glu(
    info: OffloadLayer,
    x2: mx.array,
    xbits: int,
    as_decode: np.ndarray | bool = False,
    float_op: GluOp | None = None,
) -> GluOp | None:
    """One expert's SwitchGLU on the integer GEMM, rows rounded to `xbits` bits (the
    `prompt_matmul` setting's; 0: float); None where it does not run (float, off the
    CPU kernel, weights it does not take, or every token of the call as decode).

    `as_decode` (decode_tokens'): tokens whose rows go to `float_op` (fused_glu's),
    or the template where that is None."""
    template = info.template
    if (
        xbits <= 0
        or as_decode is True
        or x2.dtype != mx.float32
        or not qmm.active()
        or not prompt_matmul.integer_available()
        or type(template).__call__ is not switch_layers.SwitchGLU.__call__
    ):
        return None
    names = projection_names(info)
    dtypes = {spec.name: spec.dtype for spec in info.layout.tensors}
    if not all(
        prompt_experts.takes(getattr(template, proj, None))
        and set(names.get(proj, {})) == {"weight", "scales", "biases"}
        and prompt_experts.scale_dtypes_ok(
            dtypes[names[proj]["scales"]], dtypes[names[proj]["biases"]]
        )
        for proj in PROJECTIONS
    ):
        return None

    def integer(x: mx.array, rows: np.ndarray, tensors: dict[str, mx.array]) -> mx.array:
        whole = len(rows) == x.shape[0] and (rows == np.arange(len(rows))).all()
        sub = x if whole else x[mx.array(rows.astype(np.uint32))]
        return prompt_experts.glu(template, sub, lambda p, key: tensors[names[p][key]], xbits)

    if as_decode is False:
        return integer

    def as_float(x: mx.array, rows: np.ndarray, tensors: dict[str, mx.array]) -> mx.array:
        if float_op is not None:
            return float_op(x, rows, tensors)
        # The CPU kernel's numbers do not depend on the sort: the template's own choice.
        zeros = mx.zeros((len(rows), 1), dtype=mx.uint32)
        out = call_template(info, x[mx.array(rows.astype(np.uint32))], zeros, [0], {0: tensors})
        return out.reshape(len(rows), -1)

    flags = np.asarray(as_decode)

    def mixed(x: mx.array, rows: np.ndarray, tensors: dict[str, mx.array]) -> mx.array:
        slow = flags[rows]
        if not slow.any():
            return integer(x, rows, tensors)
        if slow.all():
            return as_float(x, rows, tensors)
        parts = [integer(x, rows[~slow], tensors), as_float(x, rows[slow], tensors)]
        # Back in `rows`' order, as the caller's positions list them.
        order = np.argsort(np.concatenate([np.flatnonzero(~slow), np.flatnonzero(slow)]))
        return mx.concatenate(parts)[mx.array(order.astype(np.uint32))]

    return mixed
