"""GGUF files written with llama.cpp's own `gguf` package, for the GGUF tests.

`export_gguf` turns a random mlx-lm model (engine/weights/synthetic.py) into
the GGUF file llama.cpp's converter would write for the Hugging Face
checkpoint: its tensor names, q/k rows permuted for llama, Gemma's norms
stored with 1 added, experts stacked, Llama 3 RoPE scaling as a rope_freqs
tensor, and the tokenizer as gpt2-style metadata. `gguf` has no K-quant
quantizer, so K-quant tensors hold random blocks (`random_blocks`): every
bit pattern is a valid block once its float16 scales are sane.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten

from flashserve.engine.weights.gguf.synthetic import add_metadata, tokenizer_metadata

# Byte offsets of each type's float16 super-scales (d, dmin) inside a block, and the
# largest |q * sub-scale| they multiply: d is drawn so that weights stay near 0.1.
SCALE_FIELDS = {
    T.Q4_0: ([0], 8),
    T.Q4_1: ([0, 2], 15),
    T.Q5_0: ([0], 16),
    T.Q5_1: ([0, 2], 31),
    T.Q8_0: ([0], 128),
    T.Q2_K: ([80, 82], 45),
    T.Q3_K: ([108], 128),
    T.Q4_K: ([0, 2], 945),
    T.Q5_K: ([0, 2], 1953),
    T.Q6_K: ([208], 4096),
}
QUANTIZABLE = {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}

GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "gemma3_text": "gemma3",
}
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GEMMA_LAYER = {
    "pre_feedforward_layernorm": "ffn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def random_blocks(qtype: T, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random ggml blocks of `qtype` for a tensor of `shape` (uint8, rows x row bytes)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = math.prod(shape[:-1])
    raw = rng.integers(0, 256, (rows * shape[-1] // block, size), dtype=np.uint8)
    offsets, largest = SCALE_FIELDS[qtype]
    if qtype == T.Q6_K:  # sub-block scales of one sign, within 2x of each other, as ggml's
        raw[:, 192:208] = rng.integers(-128, -64, (len(raw), 16)).astype(np.int8).view(np.uint8)
    if qtype == T.Q2_K:  # 4-bit scale and minimum of each sub-block in their upper half
        raw[:, 0:16] = rng.integers(8, 16, (len(raw), 16)) * 17
    for offset in offsets:
        d = rng.uniform(0.05, 0.1, len(raw)) / largest
        raw[:, offset : offset + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


def encode(array: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """`array` in `qtype`: quantized by `gguf` where it can, else random blocks."""
    if qtype == T.F32:
        return np.ascontiguousarray(array, np.float32)
    if qtype in QUANTIZABLE:
        return gguf.quants.quantize(np.ascontiguousarray(array, np.float32), qtype)
    return random_blocks(qtype, array.shape, rng)


def write_gguf(path: Path, arch: str, metadata: dict, tensors: list[tuple[str, np.ndarray, T]]):
    """A GGUF file with `metadata` (typed by `gguf`) and already-encoded tensors."""
    writer = gguf.GGUFWriter(str(path), arch)
    add_metadata(writer, metadata)
    for name, data, qtype in tensors:
        raw = None if qtype in (T.F32,) and data.dtype == np.float32 else qtype
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gpt2_tokenizer_metadata(tokenizer_dir: Path) -> dict:
    """A synthetic model's byte-level BPE tokenizer as GGUF gpt2 tokenizer metadata."""
    # The pre-tokenizer named as older converters wrote it (flashserve reads both).
    return {**tokenizer_metadata(tokenizer_dir), "tokenizer.ggml.pre": "gpt2"}


def _gguf_name(model_type: str, name: str) -> str:
    module, _, suffix = name.rpartition(".")
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    names = {**_LAYER, **_GEMMA_LAYER} if model_type == "gemma3_text" else _LAYER
    return f"blk.{layer}.{names[rest]}.{suffix}"


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's converter: each head's two rotary halves interleaved
    shaped = rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
    return np.ascontiguousarray(shaped.swapaxes(1, 2)).reshape(rows.shape)


def llama3_rope_freqs(scaling: dict, base: float, dims: int) -> np.ndarray:
    """llama.cpp's converter: the per-frequency factors of Llama 3 RoPE scaling."""
    factors = []
    old, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    for i in range(0, dims, 2):
        wavelen = 2 * math.pi * base ** (i / dims)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, np.float32)


def export_gguf(
    model,
    config: dict,
    tokenizer_dir: Path,
    path: Path,
    qtype: Callable[[str, tuple[int, ...]], T] = lambda name, shape: T.F32,
    seed: int = 0,
) -> Path:
    """Write the GGUF llama.cpp would make of this mlx-lm model (floats unquantized)."""
    rng = np.random.default_rng(seed)
    model_type = config["model_type"]
    arch = GGUF_ARCH[model_type]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    metadata: dict = {
        f"{arch}.block_count": config["num_hidden_layers"],
        f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": config["hidden_size"],
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        f"{arch}.rope.freq_base": float(config["rope_theta"]),
        f"{arch}.rope.dimension_count": head_dim,
        **gpt2_tokenizer_metadata(tokenizer_dir),
    }
    if arch == "qwen3moe":
        metadata[f"{arch}.expert_count"] = config["num_experts"]
        metadata[f"{arch}.expert_used_count"] = config["num_experts_per_tok"]
        metadata[f"{arch}.expert_feed_forward_length"] = config["moe_intermediate_size"]
    if arch == "gemma3":
        metadata["gemma3.attention.sliding_window"] = config["sliding_window"]
        # newer converters write the layer pattern (true: sliding); llama.cpp defaults to 6
        pattern = config["sliding_window_pattern"]
        layers = range(config["num_hidden_layers"])
        metadata["gemma3.attention.sliding_window_pattern"] = [
            (i + 1) % pattern != 0 for i in layers
        ]
        metadata["gemma3.rope.freq_base_swa"] = float(config["rope_local_base_freq"])
    tensors = []
    for name, value in tree_flatten(model.parameters()):
        array = np.array(value, np.float32)
        gname = _gguf_name(model_type, name)
        base = gname.rsplit(".", 2)[-2]
        if arch == "llama" and base in ("attn_q", "attn_k"):
            array = _permute(array, heads if base == "attn_q" else kv_heads)
        if arch == "gemma3" and base.endswith("norm"):
            array = array + 1  # Gemma's norm multiplies by 1 + weight; llama.cpp's by weight
        kind = T.F32 if array.ndim == 1 else qtype(gname, array.shape)
        tensors.append((gname, encode(array, kind, rng), kind))
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":
        factors = llama3_rope_freqs(scaling, config["rope_theta"], head_dim)
        tensors.append(("rope_freqs.weight", factors, T.F32))
    write_gguf(path, arch, metadata, tensors)
    return path
