"""GGUF file -> mlx-lm model + Hugging Face-style tokenizer, and GGUF -> mlx-lm directory.

`mx.load` already parses GGUF: Q4_0/Q4_1/Q8_0 tensors arrive as MLX affine
quantization with group size 32 (`name.weight` uint32 + `name.scales` +
`name.biases`), F16/F32 as plain arrays, and other ggml types (K-quants...)
dequantized to float16. This module maps the tensor names onto mlx-lm's
module tree, builds the config, quantizes each module with the bit width its
own tensor was stored with, and turns the tokenizer metadata into a
tokenizer.json that mlx-lm's tokenizer loader (and so its streaming
detokenizers) understands (weights/gguf_tokenizer.py). The container itself is
read in weights/gguf_file.py.
"""

from __future__ import annotations

import importlib
import logging
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn

from flashserve.engine.weights.gguf_file import GGUFError, meta, read_gguf, require
from flashserve.engine.weights.gguf_tokenizer import load_tokenizer, write_tokenizer
from flashserve.engine.weights.model import compute_dtype

log = logging.getLogger(__name__)

GROUP_SIZE = 32  # every quantized ggml type mx.load maps to affine uses 32-element blocks
SUPPORTED_ARCHITECTURES = ("llama",)


# GGUF per-layer tensor name -> mlx-lm llama module path (inside model.layers.N)
_LLAMA_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LLAMA_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _bits_of(weights: dict[str, mx.array], prefix: str) -> int:
    # weight packs 32/bits values per uint32; scales hold one value per group of 32
    packed_cols = weights[f"{prefix}.weight"].shape[-1]
    groups = weights[f"{prefix}.scales"].shape[-1]
    bits, rem = divmod(packed_cols * 32, groups * GROUP_SIZE)
    if rem or bits not in (2, 3, 4, 5, 6, 8):
        raise GGUFError(f"tensor {prefix}: cannot infer its quantization bits from its shapes")
    return bits


def _rope_scaling(metadata: dict, arch: str) -> dict | None:
    kind = meta(metadata, f"{arch}.rope.scaling.type")
    factor = meta(metadata, f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or not factor or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = meta(metadata, f"{arch}.rope.scaling.original_context_length")
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise GGUFError(f"GGUF rope scaling type {kind!r} is not supported (supported: linear, yarn)")


def gguf_config(metadata: dict, weights: dict[str, mx.array]) -> dict:
    """The mlx-lm config.json dict of a GGUF model (llama architecture)."""
    arch = meta(metadata, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise GGUFError(f"GGUF architecture {arch!r} is not supported (supported: {supported})")
    if meta(metadata, f"{arch}.expert_count", 0):
        raise GGUFError("GGUF llama models with experts (MoE) are not supported")
    if "rope_freqs.weight" in weights:
        # Llama 3.1-style frequency factors live in a tensor mlx-lm's config cannot express.
        raise GGUFError("GGUF rope_freqs (Llama 3.1+ RoPE frequency factors) is not supported")

    hidden = int(require(metadata, f"{arch}.embedding_length"))
    heads = int(require(metadata, f"{arch}.attention.head_count"))
    head_dim = int(meta(metadata, f"{arch}.attention.key_length", hidden // heads))
    rope_dims = int(meta(metadata, f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFError(
            f"GGUF partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported"
        )
    if "token_embd.weight" not in weights:
        raise GGUFError("GGUF file has no token_embd.weight tensor")
    vocab_size = int(meta(metadata, f"{arch}.vocab_size", weights["token_embd.weight"].shape[0]))
    tied = "output.weight" not in weights

    config: dict[str, Any] = {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(require(metadata, f"{arch}.block_count")),
        "intermediate_size": int(require(metadata, f"{arch}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta(metadata, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta(metadata, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta(metadata, f"{arch}.rope.freq_base", 10000.0)),
        # llama.cpp's converter permutes q/k rows so that RoPE rotates adjacent
        # pairs; mlx-lm's traditional RoPE does exactly that, so no un-permuting.
        "rope_traditional": True,
        "max_position_embeddings": int(meta(metadata, f"{arch}.context_length", 4096)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "attention_bias": "blk.0.attn_q.bias" in weights,
        "mlp_bias": "blk.0.ffn_up.bias" in weights,
    }
    scaling = _rope_scaling(metadata, arch)
    if scaling:
        config["rope_scaling"] = scaling
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = meta(metadata, f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[key] = int(value)
    eos_ids = _eos_token_ids(metadata)
    if len(eos_ids) > 1:
        config["eos_token_id"] = eos_ids
    quantization = _quantization(rename_weights(weights, config["num_hidden_layers"]))
    if quantization:
        config["quantization"] = quantization
    return config


def _eos_token_ids(metadata: dict) -> list[int]:
    # llama.cpp stops on EOS and on the end-of-turn / end-of-message tokens.
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta(metadata, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def _quantization(weights: dict[str, mx.array]) -> dict | None:
    """mlx-lm quantization dict: the most common width as default, per-module overrides."""
    quantized = {name[: -len(".scales")] for name in weights if name.endswith(".scales")}
    if not quantized:
        return None
    bits = {prefix: _bits_of(weights, prefix) for prefix in sorted(quantized)}
    default = Counter(bits.values()).most_common(1)[0][0]
    quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default, "mode": "affine"}
    for prefix, b in bits.items():
        if b != default:
            quantization[prefix] = {"group_size": GROUP_SIZE, "bits": b, "mode": "affine"}
    # Linear/embedding modules stored unquantized (F16/F32) must stay plain.
    for name, value in weights.items():
        if name.endswith(".weight") and value.ndim == 2:
            prefix = name[: -len(".weight")]
            if prefix not in quantized:
                quantization[prefix] = False
    return quantization


# --------------------------------------------------------------------------- weights


def rename_weights(weights: dict[str, mx.array], num_layers: int) -> dict[str, mx.array]:
    """GGUF tensor names -> mlx-lm llama parameter names; unknown tensors are an error."""
    renamed: dict[str, mx.array] = {}
    for name, value in weights.items():
        base, _, suffix = name.rpartition(".")
        parts = base.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LLAMA_LAYER_NAMES:
            layer = int(parts[1])
            if layer >= num_layers:
                raise GGUFError(f"GGUF tensor {name} is beyond block_count {num_layers}")
            target = f"model.layers.{layer}.{_LLAMA_LAYER_NAMES[parts[2]]}"
        elif base in _LLAMA_GLOBAL_NAMES:
            target = _LLAMA_GLOBAL_NAMES[base]
        else:
            raise GGUFError(f"GGUF tensor {name} has no place in an mlx-lm llama model")
        renamed[f"{target}.{suffix}"] = value
    return renamed


def _cast(weights: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    return {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype else v
        for k, v in weights.items()
    }


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
    return model


# --------------------------------------------------------------------------- tokenizer


def _model_and_config(path: Path, dtype: mx.Dtype) -> tuple[nn.Module, dict, dict]:
    weights, metadata = read_gguf(path)
    config = gguf_config(metadata, weights)
    renamed = _cast(rename_weights(weights, config["num_hidden_layers"]), dtype)
    model = build_model(config, renamed)
    return model, config, metadata


def load_gguf(path: Path) -> tuple[nn.Module, Any, dict]:
    """Model, mlx-lm TokenizerWrapper and mlx-lm config dict of a GGUF file."""
    start = time.perf_counter()
    path = Path(path)
    model, config, metadata = _model_and_config(path, compute_dtype())
    # Going through files lets mlx-lm pick the streaming detokenizer and tool
    # parser exactly as it does for an imported directory.
    with tempfile.TemporaryDirectory(prefix="flashserve-gguf-") as tmp:
        write_tokenizer(metadata, Path(tmp), config["max_position_embeddings"])
        tokenizer = load_tokenizer(Path(tmp), _eos_token_ids(metadata))
    log.info(
        "loaded GGUF %s: %s, %d layers, %s in %.2fs",
        path.name,
        config["model_type"],
        config["num_hidden_layers"],
        _describe_quantization(config.get("quantization")),
        time.perf_counter() - start,
    )
    return model, tokenizer, config


def import_gguf(
    gguf_path: Path, out_dir: Path, force: bool = False, dtype: str | None = None
) -> Path:
    """Write an mlx-lm model directory for a GGUF file; returns out_dir.

    dtype: float type of scales, biases, norms and unquantized weights
    ("float32", "float16", "bfloat16"); None uses what load_gguf uses on this
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
    model, config, metadata = _model_and_config(Path(gguf_path), target)
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


def _describe_quantization(quantization: dict | None) -> str:
    if not quantization:
        return "unquantized"
    widths = Counter(v["bits"] for v in quantization.values() if isinstance(v, dict))
    text = f"{quantization['bits']}-bit"
    if widths:
        text += (
            " (+ "
            + ", ".join(
                f"{n} module{'s' if n > 1 else ''} at {b}-bit" for b, n in sorted(widths.items())
            )
            + ")"
        )
    return text
