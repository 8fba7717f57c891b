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

Alignment (format_version 2 and up): every tensor's data, and every expert record,
starts at a multiple of ALIGN (256) bytes in its file, and a record's tensors
at multiples of ALIGN within it. The file is read whole (or a record alone)
into one MLX buffer, so every tensor is a zero-copy view at an aligned offset
on every backend. Gaps are filled by uint8 padding tensors named
`__pad__.N` (safetensors allows no holes), which readers skip. Format 1 files
(element-size alignment only) are refused with the command that re-prepares
them: MLX's CUDA matmuls fail on views at such offsets.

manifest.json (format_version 3; 2 is read too, and has no "derived"):

    format, format_version, created, model_type, num_layers,
    layers_prefix            "model.layers." (parameter prefix of decoder layers)
    source                   {"spec", "hash"}: sha256 of config + weight file stats
    options                  {"bits", "expert_bits", "group_size"}
    quantization             {"default": {...} | null,
                              "modules": {module path: {group_size, bits, mode}}}
    checksums                {"algorithm": "crc32", "chunk_bytes": C}
    non_layer                {"file", "bytes", "tensor_bytes", "tensors": [names],
                              "crc32": [zlib.crc32 of each C-byte chunk of the file]}
    layers[i]                {"index", "file", "bytes", "tensor_bytes", "tensors": [names],
                              "crc32": [per C-byte chunk, as for non_layer],
                              "derived": [{"name", "from", "times", "nbytes"}]: tensors
                                 not in the file, `from` * `times` (weights/derived.py);
                                 "tensors" and "tensor_bytes" count them,
                              "moe": bool, "experts": null | {
                                 "file", "bytes", "tensor_bytes",
                                 "switches": [{
                                    "path": module path of the SwitchGLU,
                                    "num_experts": E,
                                    "record_bytes": R,
                                    "tensors": {"gate_proj.weight": {"dtype", "shape",
                                                "offset" (within the record, a multiple
                                                of ALIGN), "nbytes"}},
                                    "records": [[absolute file offset, R], ...]  # per expert;
                                                offsets and R are multiples of ALIGN
                                    "crc32": [zlib.crc32 of each record's bytes]  # per expert
                                 }]}}
    files                    {name: {"bytes", "crc32"}}: config, tokenizer, template files
    total_bytes              sum of every weight file's size

Checksums: every byte of a weight file that serving reads is covered. Layer
and non-layer files are checked chunk by chunk as they are read
(weights/reader.py), so verifying costs no second pass; expert files by their
records' CRCs (their headers are never read when serving). The small files are
checked at load and only warned about: editing a chat template after prepare is
legitimate. Manifests from before checksums were format 1, refused like every
format 1 directory.

A switch's stacked parameter `{path}.{name}` ([E, ...]) is split into per-expert
tensors named `{path}.{e:04d}.{name}` ([...]).
"""

from __future__ import annotations

import json
import logging
import shlex
import stat
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from flashserve.engine.weights.checksum import crc32
from flashserve.engine.weights.model import ModelLoadError

log = logging.getLogger(__name__)

FORMAT = "flashserve-prepared"
FORMAT_VERSION = 3
# Versions this flashserve reads: 2 wrote every biases tensor (3 may leave out
# those the scales give: weights/derived.py).
READABLE_VERSIONS = (2, 3)
# Every tensor and every expert record starts at a multiple of this many bytes.
# 256 is cudaMalloc's alignment, the most any MLX kernel (CUDA: cuBLASLt's
# vectorized loads; Metal) assumes of a buffer, and it costs under 256 bytes a
# tensor. With it, every view of a read buffer is zero-copy on every backend.
ALIGN = 256
PAD_PREFIX = "__pad__."  # padding tensors between aligned tensors; never loaded
MANIFEST_NAME = "manifest.json"
NON_LAYER_FILE = "non_layer.safetensors"
# A vision-language model's tower and projector, as its checkpoint holds them
# (mlx-vlm's names): always resident, read by engine/vision/tower.py.
VISION_FILE = "vision.safetensors"
# Tensors of the language model in a vision-language checkpoint; the rest is vision.
LANGUAGE_PREFIXES = ("language_model.", "model.language_model.", "lm_head.")


def layer_file(index: int) -> str:
    return f"layers/layer_{index:04d}.safetensors"


def experts_file(index: int) -> str:
    return f"experts/layer_{index:04d}.safetensors"


def align_up(n: int, to: int = ALIGN) -> int:
    """The first multiple of `to` at or after `n`."""
    return -(-n // to) * to


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


def layer_list(model: nn.Module) -> list[nn.Module] | None:
    """The list object the model keeps its decoder layers in (the forward reads it),
    or None. `model.layers` is often a property returning a slice of it, which is why
    the list is found by the layers' parameter path ("model.layers.")."""
    try:
        _, prefix = find_layers(model)
    except ModelLoadError:
        return None
    obj: Any = model
    for part in prefix.rstrip(".").split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj if isinstance(obj, list) else None


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
    version = manifest.get("format_version")
    if version not in READABLE_VERSIONS:
        why = (
            "its tensors are not aligned for GPU backends"
            if isinstance(version, int) and version < min(READABLE_VERSIONS)
            else "written by a newer flashserve"
        )
        raise ModelLoadError(
            f"{file}: prepared layout version {version}, this flashserve reads "
            f"{FORMAT_VERSION} ({why}); prepare it again: "
            f"{reprepare_command(Path(path), manifest)}"
        )
    return manifest


def is_current(path: Path) -> bool:
    """A complete prepared directory of this format version (the bench reuses those)."""
    try:
        manifest = json.loads((Path(path) / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("format_version") == FORMAT_VERSION


def reprepare_command(path: Path, manifest: dict) -> str:
    """The `flashserve prepare` command that rewrites `path` from its recorded source."""
    spec = (manifest.get("source") or {}).get("spec")
    words = ["flashserve", "prepare", "default" if spec in (None, "None") else str(spec)]
    words.append(str(path))
    options = manifest.get("options") or {}
    for name in ("bits", "expert_bits"):
        if options.get(name) is not None:
            words += [f"--{name.replace('_', '-')}", str(options[name])]
    requantized = options.get("bits") is not None or options.get("expert_bits") is not None
    if requantized and options.get("group_size") not in (None, 64):
        words += ["--group-size", str(options["group_size"])]
    words.append("--force")
    return shlex.join(words)


def checksum_chunk(manifest: dict) -> int | None:
    """Bytes per CRC32 of the weight files; None: a manifest from before checksums."""
    info = manifest.get("checksums")
    if not info:
        return None
    if info.get("algorithm") != "crc32" or int(info.get("chunk_bytes", 0)) <= 0:
        raise ModelLoadError(f"manifest checksums {info!r}: not understood")
    return int(info["chunk_bytes"])


def check_small_files(path: Path, manifest: dict) -> None:
    """Warn about config, tokenizer and template files that changed since prepare."""
    for name, entry in (manifest.get("files") or {}).items():
        file = Path(path) / name
        try:
            data = file.read_bytes()
        except OSError as exc:
            log.warning("%s: cannot be read (%s)", file, exc.strerror or exc)
            continue
        if len(data) != entry["bytes"] or crc32(data) != entry["crc32"]:
            log.warning("%s: differs from the manifest (edited after prepare?); used as is", file)


def verify_files(path: Path, manifest: dict) -> None:
    """Refuse missing, truncated or irregular weight files, naming the file.

    Only `stat`: contents are checked as they are read (weights/reader.py).
    """
    entries = [manifest["non_layer"]]
    for layer in manifest["layers"]:
        entries.append(layer)
        if layer.get("experts"):
            entries.append(layer["experts"])
    for entry in entries:
        file = Path(path) / entry["file"]
        try:
            info = file.stat()
            size = info.st_size
        except FileNotFoundError:
            raise ModelLoadError(f"{file}: missing from the prepared directory") from None
        if not stat.S_ISREG(info.st_mode):
            raise ModelLoadError(f"{file}: not a regular file")
        if size != entry["bytes"]:
            raise ModelLoadError(
                f"{file}: {size} bytes, manifest says {entry['bytes']} "
                "(truncated or changed; prepare the model again)"
            )


def expert_regions(switches: list[dict]) -> dict[str, tuple[int, int, dict]]:
    """{stacked parameter path: (offset in a layer's experts buffer, bytes per expert,
    switch)}: where streaming/streamer.py reads a layer's expert records.

    Each stacked tensor gets one region of num_experts x its per-expert bytes,
    starting at a multiple of ALIGN so every region is a zero-copy view on
    every backend. A record's tensors lie at aligned offsets,
    back to back but for the padding up to each (layout format 2).
    """
    out, at = {}, 0
    for sw in switches:
        specs = sorted(sw["tensors"].items(), key=lambda kv: kv[1]["offset"])
        ends = [0] + [align_up(int(spec["offset"]) + int(spec["nbytes"])) for _, spec in specs]
        if [int(spec["offset"]) for _, spec in specs] != ends[:-1] or (
            ends[-1] != sw["record_bytes"]
        ):
            raise ModelLoadError(
                f"{sw['path']}: expert records are not aligned back to back tensors"
            )
        for name, spec in specs:
            out[f"{sw['path']}.{name}"] = (at, int(spec["nbytes"]), sw)
            at = align_up(at + int(spec["nbytes"]) * int(sw["num_experts"]))
    return out
