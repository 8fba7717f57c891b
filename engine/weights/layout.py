"""The prepared (streaming) layout on disk: names, the manifest, and how to read them.

`flashserve prepare MODEL OUT` (weights/prepare.py) writes, under OUT:

    config.json, tokenizer files, chat template
    non_layer.safetensors              everything outside the decoder layers
    layers/layer_XXXX.safetensors      one per decoder layer, minus MoE experts
    experts/layer_XXXX.safetensors     MoE layers: one contiguous record per expert
    manifest.json                      written last, atomically

Every file is standard safetensors (8-byte little-endian header length, JSON
header, data). We write the files ourselves rather than with
`mx.save_safetensors` because its tensor order is not the name order, and the
expert files need a known order: expert e's tensors form one byte range.

manifest.json (format_version 1):

    format, format_version, created, model_type, num_layers,
    layers_prefix            "model.layers." (parameter prefix of decoder layers)
    source                   {"spec", "hash"}: sha256 of config + weight file stats
    options                  {"bits", "expert_bits", "group_size"}
    quantization             {"default": {...} | null,
                              "modules": {module path: {group_size, bits, mode}}}
    non_layer                {"file", "bytes", "tensor_bytes", "tensors": [names]}
    layers[i]                {"index", "file", "bytes", "tensor_bytes", "tensors": [names],
                              "moe": bool, "experts": null | {
                                 "file", "bytes", "tensor_bytes",
                                 "switches": [{
                                    "path": module path of the SwitchGLU,
                                    "num_experts": E,
                                    "record_bytes": R,
                                    "tensors": {"gate_proj.weight": {"dtype", "shape",
                                                "offset" (within the record), "nbytes"}},
                                    "records": [[absolute file offset, R], ...]  # per expert
                                    "crc32": [zlib.crc32 of each record's bytes]  # per expert
                                 }]}}
    total_bytes              sum of every weight file's size

A switch's stacked parameter `{path}.{name}` ([E, ...]) is split into per-expert
tensors named `{path}.{e:04d}.{name}` ([...]).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from flashserve.engine.weights.model import ModelLoadError

FORMAT = "flashserve-prepared"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
NON_LAYER_FILE = "non_layer.safetensors"


def layer_file(index: int) -> str:
    return f"layers/layer_{index:04d}.safetensors"


def experts_file(index: int) -> str:
    return f"experts/layer_{index:04d}.safetensors"


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def read_safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(data start, header) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n, header


def find_layers(model: nn.Module) -> tuple[list[nn.Module], str]:
    """The decoder layers of an mlx-lm model and their parameter prefix ("model.layers.")."""
    layers = getattr(model, "layers", None)
    if not layers:
        raise ModelLoadError(f"{type(model).__module__}: model has no decoder layers list")
    first = layers[0]
    for name, module in model.named_modules():
        if module is first and name.endswith(".0"):
            prefix = name[:-1]
            # The layers list must be the model's own list, in order.
            for i, layer in enumerate(layers[:3]):
                if _get_module(model, f"{prefix}{i}") is not layer:
                    break
            else:
                return list(layers), prefix
    raise ModelLoadError("cannot find the parameter prefix of the decoder layers")


def _get_module(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    return obj


def switch_modules(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """(relative path, module) of every SwitchGLU (stacked experts) inside a layer."""
    from mlx_lm.models.switch_layers import SwitchGLU

    return [(name, m) for name, m in layer.named_modules() if isinstance(m, SwitchGLU)]


# --- reading a prepared directory -----------------------------------------


def read_manifest(path: Path) -> dict:
    """Parse and check the manifest of a prepared directory (ModelLoadError if bad)."""
    file = Path(path) / MANIFEST_NAME
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{file}: missing (not a prepared directory)") from exc
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{file}: unreadable manifest: {exc}") from exc
    if manifest.get("format") != FORMAT:
        raise ModelLoadError(f"{file}: not a flashserve manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ModelLoadError(
            f"{file}: format version {manifest.get('format_version')} "
            f"(this flashserve reads {FORMAT_VERSION}); prepare the model again"
        )
    return manifest


def verify_files(path: Path, manifest: dict) -> None:
    """Refuse missing or truncated weight files, naming the file."""
    entries = [manifest["non_layer"]]
    for layer in manifest["layers"]:
        entries.append(layer)
        if layer.get("experts"):
            entries.append(layer["experts"])
    for entry in entries:
        file = Path(path) / entry["file"]
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise ModelLoadError(f"{file}: missing from the prepared directory") from None
        if size != entry["bytes"]:
            raise ModelLoadError(
                f"{file}: {size} bytes, manifest says {entry['bytes']} "
                "(truncated or changed; prepare the model again)"
            )
