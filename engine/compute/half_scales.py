"""Quantized embeddings with float16 scales under float32 compute: rows come out float32.

GGUF's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 scales are float16 in the file and
exact as float16, so they stay float16 (half the bytes) even where the CPU
computes in float32 (weights/model.py compute_dtype). MLX's quantized matmuls
convert such scales to the input's dtype, so a linear's output is the same as
with float32 scales; `mx.dequantize` instead computes in the scales' dtype, so
an embedding lookup would come out float16, rounded, and the hidden state
with it. Float32QuantizedEmbedding dequantizes its rows with float32 scales.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

_HALF = (mx.float16, mx.bfloat16)


class Float32QuantizedEmbedding(nn.QuantizedEmbedding):
    """A QuantizedEmbedding whose looked-up rows dequantize in float32."""

    def __call__(self, x: mx.array) -> mx.array:
        biases = self.get("biases")
        return mx.dequantize(
            self["weight"][x],
            scales=self["scales"][x].astype(mx.float32),
            biases=None if biases is None else biases[x].astype(mx.float32),
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )


def float32_embeddings(model: nn.Module) -> int:
    """On the CPU, switch quantized embeddings with half-precision scales to float32 rows.

    The modules change class in place (their arrays stay); returns how many
    changed. On a GPU the compute dtype is float16 and nothing changes.
    """
    if mx.default_device() != mx.cpu:
        return 0
    changed = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedEmbedding and module["scales"].dtype in _HALF:
            module.__class__ = Float32QuantizedEmbedding
            changed += 1
    return changed
