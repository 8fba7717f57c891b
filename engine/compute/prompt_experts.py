"""A resident MoE's prompt rows on the integer prompt GEMM (issue 57), as its offloaded
twin's: mlx-lm's SwitchGLU with each expert's rows through csrc/prompt_qgemm.cpp.

An offloaded MoE's expert-major prefill (experts/prompt_gemm.py) runs each
expert's gate and up projections, the activation and the down projection on
the integer GEMM. Served resident (no expert cache), the same model's experts
went through mlx-lm's gather_qmm on the few-row kernel, whose numbers are not
the GEMM's, so the two servings of one model gave different prompt logits.
Here a resident SwitchGLU does what the offloaded one does for a prompt chunk:
the rows routed to each expert gathered, gate and up in one call (rows rounded
once), the template's activation, down in a second call, each row's numbers its
own. So a prompt gives the same logits resident, offloaded with any expert
cache size, and at any chunking.

A call of at most `decode_limit()` tokens per sequence (a decode step, a
speculative verification) keeps mlx-lm's path, as the offloaded experts' decode
does and as the dense linears do.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import switch_layers

from flashserve.engine.compute import prompt_matmul, qmm

SCALE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)  # what the GEMM reads scales as
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def takes(module: nn.Module) -> bool:
    """A projection the integer GEMM takes: packed affine 4/8 bits, no bias (its arrays'
    dtypes are checked where they are known: here on the module, or on a record)."""
    return (
        isinstance(module, switch_layers.QuantizedSwitchLinear)
        and getattr(module, "mode", "affine") == "affine"
        and module.bits in prompt_matmul.INTEGER_BITS
        and module.group_size in prompt_matmul.INTEGER_GROUP_SIZES
        and "bias" not in module
    )


def scale_dtypes_ok(scales: mx.Dtype, biases: mx.Dtype) -> bool:
    return scales in SCALE_DTYPES and biases == scales


def glu(
    template: switch_layers.SwitchGLU,
    rows: mx.array,
    arrays: Callable[[str, str], mx.array],
    xbits: int,
) -> mx.array:
    """One expert's SwitchGLU over its `rows` on the integer GEMM: gate and up in one call
    (the rows rounded once) where their widths agree, the template's activation, down.
    `arrays(projection, key)`: the expert's weight, scales or biases."""
    ext = qmm.extension()

    def gemm(x: mx.array, projs: tuple[str, ...]) -> list[mx.array]:
        m = getattr(template, projs[0])
        return ext.prompt_qgemm(
            x,
            *([arrays(p, key) for p in projs] for key in ("weight", "scales", "biases")),
            m.group_size,
            m.bits,
            xbits,
        )

    gate, up = template.gate_proj, template.up_proj
    if (gate.bits, gate.group_size) == (up.bits, up.group_size):
        g, u = gemm(rows, ("gate_proj", "up_proj"))
    else:
        (g,), (u,) = gemm(rows, ("gate_proj",)), gemm(rows, ("up_proj",))
    return gemm(template.activation(u, g), ("down_proj",))[0]


class PromptSwitchGLU(switch_layers.SwitchGLU):
    """mlx-lm's SwitchGLU whose prompt chunks run their experts on the integer GEMM."""

    _prompt_xbits = 0  # the model's prompt_matmul setting (0: float, mlx-lm's path)

    def set_prompt_xbits(self, bits: int) -> None:
        """compute/prompt_matmul.py's set_prompt_matmul reaches the experts this way."""
        self._prompt_xbits = bits

    def _integer(self, x: mx.array) -> bool:
        return (
            self._prompt_xbits > 0
            and x.ndim == 3
            and x.shape[1] > prompt_matmul.decode_limit()
            and x.dtype == mx.float32
            and qmm.active()
            and prompt_matmul.integer_available()
            and all(self._takes_arrays(getattr(self, p)) for p in _PROJECTIONS)
        )

    @staticmethod
    def _takes_arrays(module: nn.Module) -> bool:
        scales, biases = module.get("scales"), module.get("biases")
        return (
            takes(module)
            and isinstance(module.get("weight"), mx.array)
            and scales is not None
            and biases is not None
            and scale_dtypes_ok(scales.dtype, biases.dtype)
        )

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if not self._integer(x):
            return super().__call__(x, indices)
        xbits = self._prompt_xbits
        batch, length, dims = x.shape
        k = indices.shape[-1]
        flat = x.reshape(batch * length, dims)
        # The routing is read here, as the offloaded prefill reads it: each expert's
        # rows become one call.
        slots = np.array(indices.reshape(-1).astype(mx.uint32), copy=False)
        order = np.argsort(slots, kind="stable")
        experts, starts = np.unique(slots[order], return_index=True)
        ends = np.append(starts[1:], len(order))
        outputs = []
        for expert, start, end in zip(experts.tolist(), starts, ends, strict=True):
            tokens = mx.array((order[start:end] // k).astype(np.uint32))
            outputs.append(
                glu(self, flat[tokens], lambda p, key, e=expert: getattr(self, p)[key][e], xbits)
            )
        back = mx.array(np.argsort(order).astype(np.uint32))
        out = mx.concatenate(outputs)[back]
        return out.reshape(batch, length, k, out.shape[-1])


def use_integer_experts(model: nn.Module) -> int:
    """Switch the model's plain SwitchGLUs to PromptSwitchGLU (in place; its arrays and
    the layer streamer's references stay). Returns how many changed (0 off the CPU).
    Before use_blas_for_prompts, whose set_prompt_matmul gives them the setting."""
    if mx.default_device() != mx.cpu:
        return 0
    changed = 0
    for _, module in model.named_modules():
        if type(module) is switch_layers.SwitchGLU:
            module.__class__ = PromptSwitchGLU
            changed += 1
    return changed
