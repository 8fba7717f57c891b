"""Which device MLX computes on: the `device` setting (auto | cpu | gpu).

Chosen once, when the engine loads a model (engine/loader.py), before any
weight is read: MLX's default device is process-wide, and everything after
reads it (the compute dtype in weights/model.py, the CPU-only fast paths in
compute/qmm.py and step_ops.py, the compiled decode step). `auto` takes the GPU
where this MLX build has one (Metal on macOS, CUDA with the `cuda12`/`cuda13`
extras on Linux), else the CPU.
"""

from __future__ import annotations

import logging
from typing import Literal

import mlx.core as mx

log = logging.getLogger(__name__)

DeviceChoice = Literal["auto", "cpu", "gpu"]


class DeviceError(Exception):
    """The requested device is not available in this MLX build."""


def select(choice: DeviceChoice) -> mx.Device:
    """Make `choice` MLX's default device and return it; DeviceError if it cannot be had."""
    if choice not in ("auto", "cpu", "gpu"):
        raise DeviceError(f"device {choice!r}: use auto, cpu or gpu")
    has_gpu = mx.is_available(mx.gpu)
    if choice == "gpu" and not has_gpu:
        raise DeviceError(
            "device 'gpu': this MLX build has no GPU backend (Linux: install "
            "flashserve[cuda13] or [cuda12] instead of [cpu]; macOS: Metal)"
        )
    device = mx.gpu if choice == "gpu" or (choice == "auto" and has_gpu) else mx.cpu
    if mx.default_device() != device:
        mx.set_default_device(device)
        log.info("computing on the %s (device=%s)", describe(), choice)
    return mx.default_device()


def describe() -> str:
    """'cpu', or 'gpu (NAME)' where MLX names the GPU."""
    device = mx.default_device()
    if device.type != mx.gpu:
        return "cpu"
    try:
        name = mx.device_info().get("device_name") or mx.device_info().get("architecture")
    except Exception:  # device_info differs between backends and versions
        name = None
    return f"gpu ({name})" if name else "gpu"
