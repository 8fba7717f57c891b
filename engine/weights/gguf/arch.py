"""GGUF architectures: metadata -> mlx-lm config, tensor names, and llama.cpp's tensor edits.

llama.cpp's converter changes some tensors on the way in, and each change is
undone here so that the model is the Hugging Face one mlx-lm expects:
- llama (and Mistral, which llama.cpp writes as llama): q_proj and k_proj rows
  are permuted so that RoPE rotates adjacent pairs; un-permuted here, so the
  model runs mlx-lm's default (neox-style) RoPE like the original checkpoint.
  qwen2, qwen3, qwen3moe and gemma3 use neox RoPE in llama.cpp: not permuted.
- gemma3: every RMSNorm weight is stored with 1 added (llama.cpp's norm
  multiplies by the weight, Gemma's by 1 + weight); 1 is subtracted here.
- Llama 3.1+ RoPE scaling is stored as a `rope_freqs` tensor (a factor per
  frequency) instead of its four parameters: they are recovered from it and
  checked to reproduce it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flashserve.engine.weights.gguf.container import GGUFError, meta, require

# GGUF per-layer tensor name -> mlx-lm module path inside model.layers.N
_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_MOE = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_GEMMA = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True)
class Arch:
    gguf: str  # general.architecture
    model_type: str  # mlx-lm's
    permuted_qk: bool = False
    norm_shift: float = 0.0
    layer_names: dict[str, str] = field(default_factory=lambda: dict(_LAYER))


ARCHITECTURES = {
    a.gguf: a
    for a in (
        Arch("llama", "llama", permuted_qk=True),
        Arch("qwen2", "qwen2"),
        Arch("qwen3", "qwen3"),
        Arch("qwen3moe", "qwen3_moe", layer_names={**_LAYER, **_MOE}),
        Arch("gemma3", "gemma3_text", norm_shift=1.0, layer_names={**_LAYER, **_GEMMA}),
    )
}


def architecture(metadata: dict) -> Arch:
    name = meta(metadata, "general.architecture")
    if name not in ARCHITECTURES:
        supported = ", ".join(ARCHITECTURES)
        raise GGUFError(f"GGUF architecture {name!r} is not supported (supported: {supported})")
    return ARCHITECTURES[name]


def mlx_name(arch: Arch, name: str, num_layers: int) -> str:
    """GGUF tensor name -> mlx-lm parameter name; unknown tensors are an error."""
    base, _, suffix = name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in arch.layer_names:
        layer = int(parts[1]) if parts[1].isdigit() else num_layers
        if layer >= num_layers:
            raise GGUFError(f"GGUF tensor {name} is beyond block_count {num_layers}")
        return f"model.layers.{layer}.{arch.layer_names[parts[2]]}.{suffix}"
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{suffix}"
    raise GGUFError(f"GGUF tensor {name} has no place in an mlx-lm {arch.model_type} model")


def is_norm(name: str) -> bool:
    return name.rpartition(".")[0].endswith("norm")


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (each head: halves interleaved)."""
    head_dim = rows.shape[0] // heads
    shaped = rows.reshape(heads, head_dim // 2, 2, *rows.shape[1:])
    return np.ascontiguousarray(shaped.swapaxes(1, 2)).reshape(rows.shape)


# --------------------------------------------------------------------------- config


def _rope_scaling(metadata: dict, arch: str) -> dict | None:
    kind = meta(metadata, f"{arch}.rope.scaling.type")
    factor = meta(metadata, f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or not factor or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = meta(metadata, f"{arch}.rope.scaling.original_context_length")
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise GGUFError(f"GGUF rope scaling type {kind!r} is not supported (supported: linear, yarn)")


def llama3_factors(scaling: dict, base: float, dims: int) -> np.ndarray:
    """Per-frequency factors of Llama 3 RoPE scaling, as llama.cpp's converter computes them."""
    old = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    wavelens = 2 * math.pi * base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    smooth = (old / wavelens - low) / (high - low)
    factors = np.where(wavelens > old / low, factor, 1.0)
    medium = (wavelens > old / high) & (wavelens < old / low)
    return np.where(medium, 1 / ((1 - smooth) / factor + smooth), factors)


def llama3_scaling(
    factors: np.ndarray, base: float, dims: int, metadata: dict, arch: str
) -> dict | None:
    """Llama 3 rope_scaling parameters that reproduce a `rope_freqs` tensor.

    The factors fix only the ratios of the original context to the two
    thresholds, so the original context is taken from the metadata (Llama
    3's 8192 if absent) and the two frequency factors solved for.
    """
    factors = np.asarray(factors, np.float64)
    factor = float(factors.max())
    if factor <= 1 + 1e-6:
        return None
    old = int(meta(metadata, f"{arch}.rope.scaling.original_context_length", 8192))
    wavelens = 2 * math.pi * base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    medium = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if medium.sum() >= 2:
        # smooth = old / (high - low) * (1 / wavelen) - low / (high - low), linear in 1 / wavelen
        smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelens[medium], smooth, 1)
        span = old / slope
        low = -intercept * span
        high = low + span
    elif medium.any():
        # One frequency between the thresholds: low_freq_factor 1 puts the upper
        # threshold at the original context, and that point gives the lower one.
        low = 1.0
        smooth = (1 / factors[medium][0] - 1 / factor) / (1 - 1 / factor)
        high = low + (old / wavelens[medium][0] - low) / smooth
    else:
        # None between: any two thresholds inside the gap reproduce the step.
        scaled = wavelens[factors >= factor * (1 - 1e-6)]
        unscaled = wavelens[factors <= 1 + 1e-6]
        top = float(scaled.min())
        bottom = float(unscaled.max()) if unscaled.size else top / 4
        low = old / (bottom ** (1 / 3) * top ** (2 / 3))
        high = old / (bottom ** (2 / 3) * top ** (1 / 3))
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low),
        "high_freq_factor": float(high),
        "original_max_position_embeddings": old,
    }
    if not np.allclose(llama3_factors(scaling, base, dims), factors, rtol=1e-4, atol=1e-6):
        raise GGUFError("GGUF rope_freqs does not follow Llama 3 RoPE scaling: not supported")
    return scaling


def _common(metadata: dict, arch: Arch, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    a = arch.gguf
    hidden = int(require(metadata, f"{a}.embedding_length"))
    heads = int(require(metadata, f"{a}.attention.head_count"))
    head_dim = int(meta(metadata, f"{a}.attention.key_length", hidden // heads))
    rope_dims = int(meta(metadata, f"{a}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFError(
            f"GGUF partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported"
        )
    if "token_embd.weight" not in shapes:
        raise GGUFError("GGUF file has no token_embd.weight tensor")
    config: dict[str, Any] = {
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(require(metadata, f"{a}.block_count")),
        "intermediate_size": int(meta(metadata, f"{a}.feed_forward_length", 0)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta(metadata, f"{a}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta(metadata, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta(metadata, f"{a}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta(metadata, f"{a}.context_length", 4096)),
        "vocab_size": int(meta(metadata, f"{a}.vocab_size", shapes["token_embd.weight"][0])),
        "tie_word_embeddings": "output.weight" not in shapes,
    }
    scaling = _rope_scaling(metadata, a)
    if scaling:
        config["rope_scaling"] = scaling
    return config


def gguf_config(
    metadata: dict, shapes: dict[str, tuple[int, ...]], rope_freqs: np.ndarray | None = None
) -> dict:
    """The mlx-lm config.json dict of a GGUF model (`shapes`: tensor name -> shape)."""
    arch = architecture(metadata)
    a = arch.gguf
    config = _common(metadata, arch, shapes)
    experts = int(meta(metadata, f"{a}.expert_count", 0))
    if experts and a != "qwen3moe":
        raise GGUFError(f"GGUF {a} models with experts (MoE) are not supported")
    if rope_freqs is not None:
        if a != "llama":
            raise GGUFError(f"GGUF rope_freqs in a {a} model is not supported")
        scaling = llama3_scaling(rope_freqs, config["rope_theta"], config["head_dim"], metadata, a)
        if scaling:
            config["rope_scaling"] = scaling
    if a == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in shapes
        config["mlp_bias"] = "blk.0.ffn_up.bias" in shapes
    elif (
        a == "qwen2" and config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]
    ):
        raise GGUFError("GGUF qwen2 with head_dim * heads != hidden size is not supported")
    elif a == "qwen3moe":
        moe = int(meta(metadata, f"{a}.expert_feed_forward_length", 0))
        config.update(
            num_experts=experts,
            num_experts_per_tok=int(require(metadata, f"{a}.expert_used_count")),
            moe_intermediate_size=moe or shapes["blk.0.ffn_up_exps.weight"][1],
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=bool(meta(metadata, f"{a}.expert_weights_norm", True)),
        )
        config["intermediate_size"] = config["intermediate_size"] or config["moe_intermediate_size"]
    elif a == "gemma3":
        config.update(_gemma3(metadata, config))
    return config


def _gemma3(metadata: dict, config: dict) -> dict[str, Any]:
    layers, hidden, heads = (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
    )
    # llama.cpp: queries scaled by 1/sqrt(head_dim), except Gemma 3 27B (62 layers),
    # scaled by 1/sqrt(hidden / heads); the file does not say.
    scalar = hidden // heads if layers == 62 else config["head_dim"]
    return {
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(meta(metadata, "gemma3.attention.sliding_window", 512)),
        "sliding_window_pattern": _window_pattern(metadata, layers),
        "rope_local_base_freq": float(meta(metadata, "gemma3.rope.freq_base_swa", 10000.0)),
    }


def _window_pattern(metadata: dict, layers: int) -> int:
    """Gemma 3's period of sliding-window layers: an int, or a per-layer list (true:
    sliding) that must repeat one period, as mlx-lm's model has; llama.cpp's default 6."""
    value = meta(metadata, "gemma3.attention.sliding_window_pattern", 6)
    if not isinstance(value, list):
        return int(value)
    period = value.index(False) + 1 if False in value else layers + 1
    if value != [(i + 1) % period != 0 for i in range(len(value))]:
        raise GGUFError("GGUF gemma3 sliding_window_pattern is not periodic: not supported")
    return period
