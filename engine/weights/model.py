"""What a loaded model is, and the one error a model spec that cannot load raises.

Every loader (GGUF, mlx-lm directory, prepared directory) returns a
LoadedModel; the worker, the memory report and the server read it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

log = logging.getLogger(__name__)


class ModelLoadError(Exception):
    """A model spec that cannot be loaded; the message is one line for the user."""


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    config: dict
    model_id: str
    path: Path | None
    context_length: int
    # Set by the streaming path (streaming.streamer.LayerStreamer); None when every
    # weight is resident.
    streamer: Any = None
    # Set when MoE experts are offloaded (experts.offload.ExpertOffload).
    experts: Any = None
    # The model's own context where memory bounds `context_length` to less (the
    # dense memory plan: streaming/denseplan.py); None: it does not.
    model_context_length: int | None = None
    # A vision-language model's tower, projector and image processor
    # (vision.tower.VisionModel); None for a text-only model.
    vision: Any = None


def context_length_of(config: dict) -> int:
    for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
        if config.get(key):
            return int(config[key])
    text = config.get("text_config") or {}
    return int(text.get("max_position_embeddings", 4096))


def compute_dtype() -> mx.Dtype:
    """Float dtype for scales, biases, norms and unquantized weights.

    Follows MLX's default device, which the `device` setting fixes before a
    model loads (compute/device.py). The CPU backend runs float16/bfloat16
    activations with quantized weights ~7x slower than float32, and the
    activation dtype follows the weights, so on CPU everything floating is
    float32. On a GPU (CUDA, Metal) half precision is native and halves the
    memory of the non-packed tensors; float16 rather than bfloat16: its 11
    significant bits (bfloat16: 8) keep greedy tokens closest to the float32
    CPU reference the identity tests compare with, mlx-community's quantized
    checkpoints carry float16 scales, and mlx-lm clips the residual stream of
    the models known to overflow it (Gemma 3).
    """
    return mx.float32 if mx.default_device() == mx.cpu else mx.float16


def float32_on_cpu(model: nn.Module) -> None:
    """Cast a model's half-precision tensors to float32 when computing on the CPU."""
    if compute_dtype() != mx.float32:
        return
    half = [
        (name, value.astype(mx.float32))
        for name, value in tree_flatten(model.parameters())
        if value.dtype in (mx.float16, mx.bfloat16)
    ]
    if half:
        model.load_weights(half, strict=False)
        mx.eval(model.parameters())
        log.info("cast %d half-precision tensors to float32 for the CPU backend", len(half))
