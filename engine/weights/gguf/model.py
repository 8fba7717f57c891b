"""GGUF file -> mlx-lm model, tokenizer and config; GGUF -> mlx-lm directory (`import-gguf`).

Each tensor's raw blocks are converted in numpy (weights/gguf/quants.py) and
land in the module mlx-lm has for it (weights/gguf/arch.py), quantized with
the width its own type maps to: a Q4_K_M file becomes 4-bit modules beside
8-bit ones (Q6_K, Q8_0), listed per module in the config's "quantization".
Nothing is expanded to float16, so resident bytes stay near the file's
tensor bytes. The tokenizer metadata becomes a tokenizer.json that mlx-lm's
loader, and so its streaming detokenizers, read like a downloaded model's
(weights/gguf/tokenizer.py).
"""

from __future__ import annotations

import importlib
import logging
import os
import tempfile
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_map

from flashserve.engine.compute.half_scales import float32_embeddings
from flashserve.engine.weights.gguf.arch import (
    ROPE_FREQS,
    Arch,
    architecture,
    gguf_config,
    is_norm,
    mlx_name,
    unpermute,
)
from flashserve.engine.weights.gguf.container import GGUFError, GGUFFile, meta
from flashserve.engine.weights.gguf.quants import GROUP, Quantized, check_supported, convert
from flashserve.engine.weights.gguf.tokenizer import load_tokenizer, write_tokenizer
from flashserve.engine.weights.model import compute_dtype

log = logging.getLogger(__name__)

_THREADS = max(1, min(4, os.cpu_count() or 1))
_AHEAD = 2 * _THREADS


def _eos_token_ids(metadata: dict) -> list[int]:
    # llama.cpp stops on EOS and on the end-of-turn / end-of-message tokens.
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta(metadata, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def _fix(arch: Arch, config: dict, name: str, value: np.ndarray | Quantized) -> Any:
    """Undo what llama.cpp's converter did to this tensor (weights/gguf/arch.py)."""
    base = name.rpartition(".")[0].rpartition(".")[2]
    if arch.permuted_qk and base in ("attn_q", "attn_k"):
        heads = config["num_attention_heads" if base == "attn_q" else "num_key_value_heads"]
        if isinstance(value, Quantized):
            value.weight, value.scales, value.biases = (
                unpermute(a, heads) for a in (value.weight, value.scales, value.biases)
            )
        else:
            value = unpermute(value, heads)
    if arch.norm_shift and is_norm(name):
        value = np.asarray(value, np.float32) - np.float32(arch.norm_shift)
    return value


def _converted(gguf: GGUFFile, names: list[str], compute: type) -> Iterator[Any]:
    """Each tensor converted, in order; a few at once on threads (numpy releases the GIL),
    at most `_AHEAD` waiting, so memory stays near one tensor's temporaries per thread."""
    with ThreadPoolExecutor(_THREADS, thread_name_prefix="gguf-convert") as pool:
        pending: deque[Future] = deque()
        for name in names:
            pending.append(pool.submit(convert, gguf.tensors[name], gguf.raw(name), compute))
            if len(pending) >= _AHEAD:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def read_weights(
    gguf: GGUFFile, arch: Arch, config: dict, dtype: mx.Dtype
) -> tuple[dict[str, mx.array], dict[str, int]]:
    """mlx-lm parameter name -> array, and module path -> bits of the quantized modules.

    Floats take `dtype`; quantized scales keep the dtype the conversion chose
    (float16 where exact, else `dtype`).
    """
    compute = np.float32 if dtype == mx.float32 else np.float16
    weights: dict[str, mx.array] = {}
    bits: dict[str, int] = {}
    names = [name for name in gguf.tensors if name != ROPE_FREQS]
    targets = [mlx_name(arch, name, config["num_hidden_layers"]) for name in names]
    for name, target, converted in zip(
        names, targets, _converted(gguf, names, compute), strict=True
    ):
        value = _fix(arch, config, name, converted)
        if isinstance(value, Quantized):
            prefix = target.removesuffix(".weight")
            if not target.endswith(".weight"):
                raise GGUFError(f"GGUF tensor {name} is quantized but is not a weight")
            weights[target] = mx.array(value.weight)
            for key, array in (("scales", value.scales), ("biases", value.biases)):
                scales = mx.array(array)
                weights[f"{prefix}.{key}"] = (
                    scales if scales.dtype in (mx.float16, dtype) else scales.astype(dtype)
                )
            bits[prefix] = value.bits
        else:
            weights[target] = mx.array(np.asarray(value)).astype(dtype)
    return weights, bits


def _quantization(weights: dict[str, mx.array], bits: dict[str, int]) -> dict | None:
    """mlx-lm quantization dict: the most common width as default, per-module overrides."""
    if not bits:
        return None
    default = Counter(bits.values()).most_common(1)[0][0]
    quantization: dict[str, Any] = {"group_size": GROUP, "bits": default, "mode": "affine"}
    for prefix, b in sorted(bits.items()):
        if b != default:
            quantization[prefix] = {"group_size": GROUP, "bits": b, "mode": "affine"}
    # Linear, embedding and expert weights stored as floats (F16/F32) stay plain.
    for name, value in weights.items():
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and value.ndim in (2, 3) and prefix not in bits:
            quantization[prefix] = False
    return quantization


def build_model(config: dict, weights: dict[str, mx.array]) -> nn.Module:
    """An mlx-lm model for `config`, quantized per module, with `weights` (mlx-lm names) loaded."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    quantization = config.get("quantization")
    if quantization:

        def class_predicate(path: str, layer: nn.Module) -> bool | dict:
            if path in quantization:
                return quantization[path]
            return hasattr(layer, "to_quantized") and f"{path}.scales" in weights

        nn.quantize(
            model,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            mode=quantization.get("mode", "affine"),
            class_predicate=class_predicate,
        )
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    model.eval()
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise GGUFError(f"GGUF tensors do not fit the {config['model_type']} model: {exc}") from exc
    mx.eval(model.parameters())
    float32_embeddings(model)
    return model


def _model_and_config(path: Path, dtype: mx.Dtype) -> tuple[nn.Module, dict, dict, GGUFFile]:
    gguf = GGUFFile(path)
    for info in gguf.tensors.values():  # refuse before converting anything
        try:
            check_supported(info)
        except GGUFError as exc:
            raise GGUFError(f"{path}: {exc}") from None
    arch = architecture(gguf.metadata)
    rope_freqs = None
    if ROPE_FREQS in gguf.tensors:
        info = gguf.tensors[ROPE_FREQS]
        rope_freqs = np.asarray(convert(info, gguf.raw(ROPE_FREQS), np.float32), np.float64)
    shapes = {name: info.shape for name, info in gguf.tensors.items()}
    config = gguf_config(gguf.metadata, shapes, rope_freqs)
    for key in ("bos_token_id", "eos_token_id"):
        value = meta(gguf.metadata, f"tokenizer.ggml.{key}")
        if value is not None:
            config[key] = int(value)
    eos_ids = _eos_token_ids(gguf.metadata)
    if len(eos_ids) > 1:
        config["eos_token_id"] = eos_ids
    weights, bits = read_weights(gguf, arch, config, dtype)
    quantization = _quantization(weights, bits)
    if quantization:
        config["quantization"] = quantization
    model = build_model(config, weights)
    return model, config, gguf.metadata, gguf


def resident_bytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def load_gguf(path: Path) -> tuple[nn.Module, Any, dict]:
    """Model, mlx-lm TokenizerWrapper and mlx-lm config dict of a GGUF file."""
    start = time.perf_counter()
    path = Path(path)
    model, config, metadata, gguf = _model_and_config(path, compute_dtype())
    # Going through files lets mlx-lm pick the streaming detokenizer and tool
    # parser exactly as it does for an imported directory.
    with tempfile.TemporaryDirectory(prefix="flashserve-gguf-") as tmp:
        write_tokenizer(metadata, Path(tmp), config["max_position_embeddings"])
        tokenizer = load_tokenizer(Path(tmp), _eos_token_ids(metadata))
    types = Counter(info.type_name for info in gguf.tensors.values())
    log.info(
        "loaded GGUF %s: %s, %d layers, tensors %s; %.1f MB resident for %.1f MB in the file; "
        "%.2fs",
        path.name,
        config["model_type"],
        config["num_hidden_layers"],
        ", ".join(f"{n} {t}" for t, n in types.most_common()),
        resident_bytes(model) / 1e6,
        gguf.tensor_bytes / 1e6,
        time.perf_counter() - start,
    )
    return model, tokenizer, config


def import_gguf(
    gguf_path: Path, out_dir: Path, force: bool = False, dtype: str | None = None
) -> Path:
    """Write an mlx-lm model directory for a GGUF file; returns out_dir.

    dtype: float type of scales, biases, norms and unquantized weights
    ("float32", "float16", "bfloat16"); None uses the compute dtype of this
    device, so `mlx_lm.load(out_dir)` gives the same greedy tokens as the GGUF.
    """
    from mlx_lm.utils import save_config, save_model

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise GGUFError(f"{out_dir}: exists and is not a directory")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise GGUFError(f"{out_dir}: directory is not empty (use force to write into it)")
    if dtype is None:
        target = compute_dtype()
    elif dtype in ("float32", "float16", "bfloat16"):
        target = getattr(mx, dtype)
    else:
        raise GGUFError(f"dtype {dtype!r} is not one of float32, float16, bfloat16")
    model, config, metadata, _ = _model_and_config(Path(gguf_path), target)
    # mlx-lm's own QuantizedEmbedding dequantizes in its scales' dtype: every
    # float takes the target dtype here, float16 scales included.
    model.update(
        tree_map(
            lambda a: a.astype(target) if mx.issubdtype(a.dtype, mx.floating) else a,
            model.parameters(),
        )
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    # mlx-lm loads every model*.safetensors it finds: stale shards of an earlier
    # import would be mixed in, so they go; other files are overwritten or kept.
    for stale in out_dir.glob("model*.safetensors*"):
        stale.unlink()
    save_model(out_dir, model)
    config = dict(config)
    config["torch_dtype"] = str(target).rpartition(".")[2]
    save_config(config, out_dir / "config.json")
    write_tokenizer(metadata, out_dir, config["max_position_embeddings"])
    log.info("imported %s into %s", Path(gguf_path).name, out_dir)
    return out_dir
