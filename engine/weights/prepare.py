"""Split a model into the streaming layout (`flashserve prepare MODEL OUT`).

The layout and the manifest are described in weights/layout.py. Every file is
standard safetensors, written here rather than with `mx.save_safetensors`
because its tensor order is not the name order, and the expert files need a
known order: expert e's tensors form one byte range.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map

from flashserve.engine.weights import derived
from flashserve.engine.weights.checksum import crc32
from flashserve.engine.weights.layout import (
    ALIGN,
    FORMAT,
    FORMAT_VERSION,
    LANGUAGE_PREFIXES,
    MANIFEST_NAME,
    NON_LAYER_FILE,
    PAD_PREFIX,
    VISION_FILE,
    align_up,
    dtype_name,
    experts_file,
    find_layers,
    layer_file,
    switch_modules,
)
from flashserve.engine.weights.reader import CHUNK_BYTES, ST_DTYPES, file_crcs
from flashserve.engine.weights.sources import is_prepared, load_plain, resolve

log = logging.getLogger(__name__)

_OWNED = (MANIFEST_NAME, NON_LAYER_FILE, "layers", "experts")
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".npz")

ProgressFn = Callable[[int, int, str], None]

_ST_DTYPES = {dtype: name for name, dtype in ST_DTYPES.items()}


class PrepareError(Exception):
    """prepare cannot run with these arguments; the message is one line for the user."""


# --- safetensors writing ---------------------------------------------------


def _raw_bytes(arr: mx.array) -> np.ndarray:
    # numpy has no bfloat16; the bytes are what matter, so view as uint16.
    if arr.dtype == mx.bfloat16:
        arr = arr.view(mx.uint16)
    return np.ascontiguousarray(np.asarray(arr))


@dataclass
class Tensor:
    """One tensor to write: its dtype and shape, and its bytes as a numpy array."""

    dtype: mx.Dtype
    shape: tuple[int, ...]
    data: np.ndarray

    @classmethod
    def of(cls, arr: mx.array) -> Tensor:
        return cls(arr.dtype, tuple(arr.shape), _raw_bytes(arr))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def write_safetensors(
    path: Path, tensors: list[tuple[str, Tensor]], metadata: dict[str, str] | None = None
) -> tuple[int, dict[str, int]]:
    """Write `tensors` in the given order; return (data start, {name: absolute offset}).

    Every tensor, and the end of the data, lands at a multiple of ALIGN in the
    file (layout.py): the header is padded with spaces, the gaps between
    tensors are uint8 tensors named PAD_PREFIX + N (safetensors allows no holes).
    """
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "mlx"}}
    order: list[tuple[str, Tensor]] = []
    offset = 0

    def pad_to(end: int) -> None:
        nonlocal offset
        if end > offset:
            name = f"{PAD_PREFIX}{len(order)}"
            order.append(
                (name, Tensor(mx.uint8, (end - offset,), np.zeros(end - offset, np.uint8)))
            )
            header[name] = {"dtype": "U8", "shape": [end - offset], "data_offsets": [offset, end]}
            offset = end

    for name, t in tensors:
        if t.dtype not in _ST_DTYPES:
            raise PrepareError(f"{name}: dtype {t.dtype} cannot be stored in safetensors")
        pad_to(align_up(offset))
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        order.append((name, t))
        offset += t.nbytes
    pad_to(align_up(offset))
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % ALIGN)  # the data starts ALIGN-aligned
    start = 8 + len(blob)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, t in order:
            f.write(t.data.reshape(-1).view(np.uint8).data)
    offsets = {name: start + header[name]["data_offsets"][0] for name, _ in tensors}
    return start, offsets


# --- model introspection ---------------------------------------------------


def quantized_modules(model: nn.Module) -> dict[str, dict]:
    """{module path: {group_size, bits, mode}} for every quantized module."""
    found = {}
    for name, m in model.named_modules():
        if "scales" in m and isinstance(getattr(m, "bits", None), int):
            found[name] = {
                "group_size": int(m.group_size),
                "bits": int(m.bits),
                "mode": getattr(m, "mode", "affine"),
            }
    return found


def _num_experts(switch: nn.Module) -> int:
    return int(switch.gate_proj.weight.shape[0])


# --- source ----------------------------------------------------------------


@dataclass
class _Source:
    model: nn.Module
    tokenizer: Any
    config: dict
    path: Path | None
    is_gguf: bool


def _load_source(model_spec: str | None) -> _Source:
    target = resolve(model_spec)
    if is_prepared(target):
        raise PrepareError(f"{target}: already a prepared directory")
    # Lazy for mlx-lm models: each layer's weights are read from the source only
    # when that layer is written, so a model larger than memory can be prepared.
    model, tokenizer, config = load_plain(target, lazy=True)
    path = target if isinstance(target, Path) else None
    return _Source(
        model, tokenizer, dict(config), path, is_gguf=path is not None and path.is_file()
    )


def source_hash(path: Path | None, spec: str | None) -> str:
    """sha256 of the source's config and its weight files' names, sizes and mtimes.

    Cheap by design: it identifies the source, it does not checksum gigabytes.
    """
    h = hashlib.sha256()
    h.update(str(spec).encode())
    if path is None:
        return h.hexdigest()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    for p in files:
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        if p.name == "config.json":
            h.update(p.read_bytes())
    return h.hexdigest()


# --- re-quantization -------------------------------------------------------


def _requantize(
    model: nn.Module, bits: int | None, expert_bits: int | None, group_size: int
) -> None:
    from mlx_lm.utils import dequantize_model

    if quantized_modules(model):
        dequantize_model(model)  # lazy: re-quantize from the dequantized values
    expert_paths = set()
    layers, prefix = find_layers(model)
    for i, layer in enumerate(layers):
        for sp, sw in switch_modules(layer):
            for name, _ in sw.named_modules():
                if name:
                    expert_paths.add(f"{prefix}{i}.{sp}.{name}")
    model_predicate = getattr(model, "quant_predicate", None)

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not hasattr(module, "to_quantized") or "weight" not in module:
            return False
        if module.weight.shape[-1] % group_size:
            return False
        width = expert_bits if path in expert_paths else bits
        if width is None:
            return False
        params: dict = {"group_size": group_size, "bits": width, "mode": "affine"}
        if model_predicate is not None:
            verdict = model_predicate(path, module)
            if verdict is False:
                return False
            if isinstance(verdict, dict):  # e.g. qwen3_next keeps its router at 8 bits
                params = {"mode": "affine", **verdict}
        return params

    nn.quantize(model, group_size=group_size, bits=bits or expert_bits, class_predicate=predicate)


# --- output directory ------------------------------------------------------


def _claim_output(out: Path, force: bool, source: Path | None) -> None:
    if source is not None and out.resolve() == source.resolve():
        raise PrepareError(f"{out}: OUT must differ from the source model")
    if out.exists() and not out.is_dir():
        raise PrepareError(f"{out}: exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise PrepareError(f"{out}: directory is not empty (use --force to overwrite)")
        # Manifest first: from here on the directory no longer looks complete.
        (out / MANIFEST_NAME).unlink(missing_ok=True)
        for name in _OWNED:
            p = out / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _write_tokenizer(src: _Source, out: Path) -> list[str]:
    """Write the tokenizer files; return their names."""
    if src.is_gguf or src.path is None or not src.path.is_dir():
        # A GGUF tokenizer lives in memory; save it as HF files (+ chat template).
        saved = src.tokenizer._tokenizer.save_pretrained(str(out))
        return [Path(p).name for p in saved if Path(p).parent == out and Path(p).is_file()]
    names = []
    for p in sorted(src.path.iterdir()):
        if not p.is_file() or p.name in ("config.json", MANIFEST_NAME):
            continue
        if p.name.endswith(_WEIGHT_SUFFIXES) or p.name.endswith(".safetensors.index.json"):
            continue
        shutil.copy2(p, out / p.name)
        names.append(p.name)
    return names


def _write_vision(src: _Source, out: Path) -> list[str]:
    """A vision-language model's tower and projector, copied as they are (the
    language model's mlx-lm class drops them as it loads); their names."""
    if not src.config.get("vision_config") or src.path is None or not src.path.is_dir():
        return []
    tensors: dict[str, mx.array] = {}
    for file in sorted(src.path.glob("*.safetensors")):
        loaded = mx.load(str(file))
        assert isinstance(loaded, dict)
        tensors.update({k: v for k, v in loaded.items() if not k.startswith(LANGUAGE_PREFIXES)})
    if not tensors:
        return []
    mx.save_safetensors(str(out / VISION_FILE), tensors, metadata={"format": "mlx"})
    return [VISION_FILE]


def _write_config(config: dict, quant: dict[str, dict], out: Path) -> dict | None:
    from mlx_lm.utils import save_config

    config = dict(config)
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    default = None
    if quant:
        ((default_key, _),) = Counter(
            (q["group_size"], q["bits"], q["mode"]) for q in quant.values()
        ).most_common(1)
        default = {"group_size": default_key[0], "bits": default_key[1], "mode": default_key[2]}
        # mlx-lm infers unlisted modules from their scales; list the ones
        # whose width differs from the default so the shapes come out right.
        entries = {p: q for p, q in quant.items() if q != default}
        config["quantization"] = {**default, **entries}
    # A vision model's tower is rebuilt from vision_config (vision.safetensors beside).
    save_config(config, out / "config.json", keep_vision_config=bool(config.get("vision_config")))
    return default


def _atomic_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --- the split -------------------------------------------------------------


def _tensor_bytes(tensors: Iterable[tuple[str, Tensor]]) -> int:
    return sum(a.nbytes for _, a in tensors)


def _write_layer(out: Path, index: int, prefix: str, layer: nn.Module) -> dict[str, Any]:
    lp = f"{prefix}{index}."
    params = dict(tree_flatten(layer.parameters()))
    switches = switch_modules(layer)
    expert_params: dict[str, list[tuple[str, mx.array]]] = {}
    for sp, sw in switches:
        count = _num_experts(sw)
        stacked = [
            (name[len(sp) + 1 :], arr)
            for name, arr in params.items()
            if name.startswith(sp + ".") and arr.ndim >= 1 and arr.shape[0] == count
        ]
        expert_params[sp] = stacked
        for name, _ in stacked:
            params.pop(f"{sp}.{name}")
    mx.eval(list(params.values()), [a for s in expert_params.values() for _, a in s])

    left_out = _derived_biases(layer, params)
    dense = [
        (lp + name, Tensor.of(params[name])) for name in sorted(params) if name not in left_out
    ]
    path = out / layer_file(index)
    write_safetensors(path, dense)
    entry: dict[str, Any] = {
        "index": index,
        "file": layer_file(index),
        "bytes": path.stat().st_size,
        "tensor_bytes": _tensor_bytes(dense) + sum(params[n].nbytes for n in left_out),
        "tensors": [lp + name for name in sorted(params)],
        "crc32": file_crcs(path, CHUNK_BYTES),
        "moe": bool(switches),
        "experts": None,
    }
    if left_out:
        entry["derived"] = [
            {"name": lp + n, "from": lp + src, "times": times, "nbytes": params[n].nbytes}
            for n, (src, times) in sorted(left_out.items())
        ]
    if switches:
        entry["experts"] = _write_experts(out, index, lp, switches, expert_params)
    return entry


def _derived_biases(layer: nn.Module, params: dict[str, mx.array]) -> dict[str, tuple[str, int]]:
    """The affine biases of `layer`'s dense quantized linears that their scales give
    bit for bit (weights/derived.py): {biases name: (scales name, times)}."""
    out = {}
    for name, module in layer.named_modules():
        if getattr(module, "mode", "affine") != "affine" or not hasattr(module, "bits"):
            continue
        scales, biases = f"{name}.scales", f"{name}.biases"  # a linear inside the layer
        if scales in params and biases in params:
            times = derived.derivable(params[scales], params[biases], int(module.bits))
            if times is not None:
                out[biases] = (scales, times)
    return out


def _write_experts(
    out: Path,
    index: int,
    lp: str,
    switches: list[tuple[str, nn.Module]],
    expert_params: dict[str, list[tuple[str, mx.array]]],
) -> dict[str, Any]:
    tensors: list[tuple[str, Tensor]] = []
    layouts = []
    for sp, sw in switches:
        count = _num_experts(sw)
        names = sorted(n for n, _ in expert_params[sp])
        by_name = {n: Tensor.of(a) for n, a in expert_params[sp]}
        table, rel = {}, 0
        for name in names:
            arr = by_name[name]
            nbytes = arr.nbytes // count
            table[name] = {
                "dtype": dtype_name(arr.dtype),
                "shape": list(arr.shape[1:]),
                "offset": rel,
                "nbytes": nbytes,
            }
            # Each tensor at an aligned offset within the record, and the record's
            # length a multiple of ALIGN: the next record starts aligned too.
            rel = align_up(rel + nbytes)
        # Expert-major order: expert e's tensors are one contiguous record.
        for e in range(count):
            for name in names:
                t = by_name[name]
                tensors.append(
                    (f"{lp}{sp}.{e:04d}.{name}", Tensor(t.dtype, t.shape[1:], t.data[e]))
                )
        layouts.append(
            {
                "path": f"{lp}{sp}",
                "num_experts": count,
                "record_bytes": rel,
                "tensors": table,
                "names": names,
            }
        )
    path = out / experts_file(index)
    _, offsets = write_safetensors(path, tensors)
    switches_out = []
    for layout in layouts:
        records = []
        for e in range(layout["num_experts"]):
            first = offsets[f"{layout['path']}.{e:04d}.{layout['names'][0]}"]
            # Verify the record really is contiguous in the header we wrote.
            for name in layout["names"]:
                got = offsets[f"{layout['path']}.{e:04d}.{name}"] - first
                assert got == layout["tensors"][name]["offset"], (name, got)
            records.append([first, layout["record_bytes"]])
        layout = {k: v for k, v in layout.items() if k != "names"}
        layout["records"] = records
        # Per-record checksums of the bytes on disk: the expert cache verifies
        # each read, so a corrupted file is reported naming layer and expert.
        layout["crc32"] = _record_crcs(path, records)
        switches_out.append(layout)
    return {
        "file": experts_file(index),
        "bytes": path.stat().st_size,
        "tensor_bytes": _tensor_bytes(tensors),
        "switches": switches_out,
    }


def _record_crcs(path: Path, records: list[list[int]]) -> list[int]:
    with open(path, "rb") as f:
        out = []
        for offset, length in records:
            f.seek(offset)
            out.append(crc32(f.read(length)))
        return out


def _small_files(out: Path, names: list[str]) -> dict[str, dict[str, int]]:
    """Size and CRC32 of the files written beside the weights (config, tokenizer, template)."""
    found = {}
    for name in sorted(set(names)):
        data = (out / name).read_bytes()
        found[name] = {"bytes": len(data), "crc32": crc32(data)}
    return found


def _release(module: nn.Module) -> None:
    # Drop the written weights so peak memory stays near one layer.
    empty = mx.zeros((0,))
    module.update(tree_map(lambda _: empty, module.parameters()))


def prepare(
    model_spec: str | None,
    out: Path,
    *,
    bits: int | None = None,
    expert_bits: int | None = None,
    group_size: int = 64,
    force: bool = False,
    progress: ProgressFn | None = None,
) -> Path:
    """Write the streaming layout of `model_spec` (anything `serve` loads) to `out`.

    `bits` re-quantizes every non-expert weight, `expert_bits` the MoE experts
    (default: `bits`). Refuses a non-empty `out` unless `force`. Progress is
    logged per layer and, if given, reported as progress(done, total, message).
    Returns `out`. The manifest is written last and atomically, so an
    interrupted run never leaves a directory that loads.
    """
    out = Path(out).expanduser()
    if out.exists() and any(out.iterdir()) and not force:
        raise PrepareError(f"{out}: directory is not empty (use --force to overwrite)")
    for name, value in (("bits", bits), ("expert_bits", expert_bits)):
        if value is not None and value not in (2, 3, 4, 5, 6, 8):
            raise PrepareError(f"--{name.replace('_', '-')} must be one of 2, 3, 4, 5, 6, 8")
    if group_size not in (32, 64, 128):
        raise PrepareError("--group-size must be 32, 64 or 128")
    started = time.perf_counter()
    src = _load_source(model_spec)
    _claim_output(out, force, src.path)
    model = src.model
    if bits is not None or expert_bits is not None:
        _requantize(model, bits, expert_bits if expert_bits is not None else bits, group_size)
    layers, prefix = find_layers(model)
    quant = quantized_modules(model)
    total = len(layers) + 1

    small_files = [*_write_tokenizer(src, out), *_write_vision(src, out), "config.json"]
    default_quant = _write_config(src.config, quant, out)

    non_layer_arrays = [
        (name, arr) for name, arr in tree_flatten(model.parameters()) if not name.startswith(prefix)
    ]
    mx.eval([a for _, a in non_layer_arrays])
    non_layer = sorted(((n, Tensor.of(a)) for n, a in non_layer_arrays), key=lambda t: t[0])
    del non_layer_arrays
    write_safetensors(out / NON_LAYER_FILE, non_layer)
    non_layer_entry = {
        "file": NON_LAYER_FILE,
        "bytes": (out / NON_LAYER_FILE).stat().st_size,
        "tensor_bytes": _tensor_bytes(non_layer),
        "tensors": [n for n, _ in non_layer],
        "crc32": file_crcs(out / NON_LAYER_FILE, CHUNK_BYTES),
    }
    del non_layer
    _report(
        progress, 1, total, f"non-layer weights: {non_layer_entry['tensor_bytes'] / 1e6:.1f} MB"
    )

    layer_entries = []
    for i, layer in enumerate(layers):
        entry = _write_layer(out, i, prefix, layer)
        _release(layer)
        layer_entries.append(entry)
        size = entry["tensor_bytes"] + (entry["experts"] or {}).get("tensor_bytes", 0)
        kind = "MoE layer" if entry["moe"] else "layer"
        _report(progress, i + 2, total, f"{kind} {i}/{len(layers)}: {size / 1e6:.1f} MB")

    weight_files = [non_layer_entry["bytes"]] + [
        e["bytes"] + (e["experts"] or {}).get("bytes", 0) for e in layer_entries
    ]
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model_type": src.config.get("model_type"),
        "num_layers": len(layers),
        "layers_prefix": prefix,
        "moe_layers": [e["index"] for e in layer_entries if e["moe"]],
        "source": {"spec": str(model_spec), "hash": source_hash(src.path, model_spec)},
        "options": {"bits": bits, "expert_bits": expert_bits, "group_size": group_size},
        "quantization": {"default": default_quant, "modules": quant},
        "checksums": {"algorithm": "crc32", "chunk_bytes": CHUNK_BYTES},
        "files": _small_files(out, small_files),
        "non_layer": non_layer_entry,
        "layers": layer_entries,
        "total_bytes": sum(weight_files),
    }
    _atomic_json(out / MANIFEST_NAME, manifest)
    log.info(
        "prepared %s -> %s: %d layers (%d MoE), %.1f MB in %.1fs",
        model_spec or "default model",
        out,
        len(layers),
        len(manifest["moe_layers"]),
        manifest["total_bytes"] / 1e6,
        time.perf_counter() - started,
    )
    return out


def _report(progress: ProgressFn | None, done: int, total: int, message: str) -> None:
    log.info("prepare [%d/%d] %s", done, total, message)
    if progress is not None:
        progress(done, total, message)
