"""Tiny random vision-language models in mlx-vlm's format, written to disk.

Tests (and later the benchmark) need a real model directory with a real
image processor: config.json as mlx-vlm and mlx-lm read it, safetensors with
the vision tower, projector and language model, and the processor's
preprocessor_config.json (transformers' PIL image processor: no torch).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from flashserve.engine.weights.synthetic import ARCHITECTURES, build_tokenizer

log = logging.getLogger(__name__)

# What both processors do to pixels: resized, scaled to [0, 1], normalized to [-1, 1].
_PIXELS = {
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
}
GEMMA3_IMAGE_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")


def make_gemma3_vlm(
    out: str | Path,
    *,
    seed: int = 0,
    image_size: int = 56,
    tokens_per_image: int = 4,
    text: dict | None = None,
    vision: dict | None = None,
    chat_template: str | None = None,
) -> Path:
    """A Gemma 3 vision-language model: 4 text layers (heads of 32), a 2-layer SigLIP
    tower on `image_size` pixels in 14-pixel patches, 4 tokens per image; `text` and
    `vision` change their configs (the benchmark's larger model), `chat_template`
    the tokenizer's ChatML (the agent tests' Qwen3 template, for its tool calls)."""
    from mlx_vlm.models import gemma3

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(
        out, chat_template=chat_template, extra_special_tokens=GEMMA3_IMAGE_TOKENS
    )
    with open(out / "tokenizer.json") as f:
        ids = {t["content"]: t["id"] for t in json.load(f)["added_tokens"]}
    overrides = text or {}
    text = {**ARCHITECTURES["gemma3_text"], "vocab_size": vocab}
    # Heads of 32: the smallest kv_bits group (MLX quantizes in groups of 32, 64, 128).
    text.update(head_dim=32, query_pre_attn_scalar=32, mm_tokens_per_image=tokens_per_image)
    text.update(overrides)
    vision = {
        "model_type": "siglip_vision_model",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "patch_size": 14,
        "image_size": image_size,
        **(vision or {}),
    }
    boi, image, eoi = (ids[t] for t in GEMMA3_IMAGE_TOKENS)
    config = {
        "model_type": "gemma3",
        "text_config": text,
        "vision_config": vision,
        "vocab_size": vocab,
        "hidden_size": text["hidden_size"],
        "image_token_index": image,
        "boi_token_index": boi,
        "eoi_token_index": eoi,
        "mm_tokens_per_image": tokens_per_image,
        "eos_token_id": ids["<|im_end|>"],
    }
    model_config = gemma3.ModelConfig.from_dict(config)
    model_config.text_config = gemma3.TextConfig.from_dict(text)
    model_config.vision_config = gemma3.VisionConfig.from_dict(vision)
    mx.random.seed(seed)
    _write(out, gemma3.Model(model_config), config)
    processor = {
        "image_processor_type": "Gemma3ImageProcessor",
        "size": {"height": image_size, "width": image_size},
        **_PIXELS,
        "do_pan_and_scan": False,
        "resample": 2,
    }
    with open(out / "preprocessor_config.json", "w") as f:
        json.dump(processor, f, indent=2)
    log.info("wrote a gemma3 vision-language model to %s", out)
    return out


def _write(out: Path, model: Any, config: dict) -> None:
    """The model's weights (mlx-vlm's names) and config.json."""
    # As weights/synthetic.py: every parameter perturbed, so wrong weights show.
    model.update(tree_map(lambda p: p + 0.02 * mx.random.normal(p.shape), model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2)


QWEN_IMAGE_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")


def make_qwen3_5_vlm(
    out: str | Path,
    *,
    seed: int = 0,
    moe: bool = False,
    max_pixels: int = 96 * 96,
    real_rope: bool = False,
) -> Path:
    """A Qwen3.5 vision-language model (`moe`: Qwen3.5-MoE): 4 text layers, gated
    delta-net and full attention alternating (heads of 32, a quarter rotated by
    M-RoPE), a 2-layer tower on 16-pixel patches merged 2 x 2; Qwen's image processor
    sizes an image to at most `max_pixels`, so a 64 x 96 image is 2 x 3 tokens.
    `real_rope`: Qwen3.5's own rotary layout, heads of 256 (a quarter rotated: 32
    frequencies in sections of 11, 11 and 10)."""
    from mlx_vlm.models import qwen3_5, qwen3_5_moe

    family = qwen3_5_moe if moe else qwen3_5
    kind = "qwen3_5_moe" if moe else "qwen3_5"
    out = Path(out)
    vocab, ids = _qwen_tokenizer(out)
    text = {
        **_qwen_text(kind, vocab, heads=4, kv_heads=2, head_dim=256 if real_rope else 32),
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "rope_parameters": {
            "rope_type": "default",
            # Of the frequencies a quarter of the head rotates: 4 (heads of 32) or 32.
            "mrope_section": [11, 11, 10] if real_rope else [2, 1, 1],
            "mrope_interleaved": True,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    }
    if moe:
        text.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
    vision = _qwen3_tower(kind, deepstack=[])
    config = {"model_type": kind, "text_config": text, "vision_config": vision, **ids}
    model_config = family.ModelConfig.from_dict(config)
    model_config.text_config = family.TextConfig.from_dict(text)
    model_config.vision_config = family.VisionConfig.from_dict(vision)
    mx.random.seed(seed)
    _write(out, family.Model(model_config), config)
    _qwen_processor(out, 16, max_pixels)
    log.info("wrote a %s vision-language model to %s", kind, out)
    return out


def make_qwen2_5_vl(out: str | Path, *, seed: int = 0, max_pixels: int = 84 * 84) -> Path:
    """A Qwen2.5-VL model: 4 qwen2 text layers (heads of 32, every dimension rotated
    by M-RoPE in Qwen2.5-VL's chunked sections), a 2-layer windowed tower on
    14-pixel patches merged 2 x 2; a 56 x 84 image is 2 x 3 tokens."""
    from mlx_vlm.models import qwen2_5_vl

    out = Path(out)
    _, ids = _qwen_tokenizer(out)  # the vocabulary size is in ids
    vision = {
        "model_type": "qwen2_5_vl",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "num_heads": 2,
        "patch_size": 14,
        "spatial_patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,  # 2 x 2 merged tokens a window: a 2 x 3 image has two
        "fullatt_block_indexes": [1],
        "in_channels": 3,
    }
    config = {  # Qwen2.5-VL's config.json: the text model's settings at the top
        "model_type": "qwen2_5_vl",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
        "vision_config": vision,
        **ids,
    }
    model_config = qwen2_5_vl.ModelConfig.from_dict(dict(config))
    model_config.text_config = qwen2_5_vl.TextConfig.from_dict(model_config.text_config)
    model_config.vision_config = qwen2_5_vl.VisionConfig.from_dict(vision)
    mx.random.seed(seed)
    _write(out, qwen2_5_vl.Model(model_config), config)
    _qwen_processor(out, 14, max_pixels)
    log.info("wrote a qwen2_5_vl vision-language model to %s", out)
    return out


def make_qwen3_vl(
    out: str | Path,
    *,
    seed: int = 0,
    moe: bool = False,
    max_pixels: int = 96 * 96,
    chat_template: str | None = None,
    text: dict | None = None,
) -> Path:
    """A Qwen3-VL model (`moe`: Qwen3-VL-MoE): 4 qwen3 text layers (heads of 32, all
    rotated by M-RoPE in interleaved sections), a 2-layer tower on 16-pixel patches
    merged 2 x 2 whose two layers' deepstack features join the first two text layers'
    hidden states. `chat_template` replaces the tokenizer's ChatML (the agent tests'
    Qwen3 template), `text` changes the text config (their one head, long context)."""
    from mlx_vlm.models import qwen3_vl, qwen3_vl_moe

    family = qwen3_vl_moe if moe else qwen3_vl
    kind = "qwen3_vl_moe" if moe else "qwen3_vl"
    out = Path(out)
    vocab, ids = _qwen_tokenizer(out, chat_template)
    overrides = text or {}
    text = {
        **_qwen_text(kind, vocab, heads=2, kv_heads=1),
        "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "default", "mrope_section": [8, 4, 4],
                         "mrope_interleaved": True},
        **overrides,
    }  # fmt: skip
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)  # fmt: skip
    vision = _qwen3_tower(kind, deepstack=[0, 1])
    config = {"model_type": kind, "text_config": text, "vision_config": vision, **ids}
    model_config = family.ModelConfig.from_dict(config)
    mx.random.seed(seed)
    _write(out, family.Model(model_config), config)
    _qwen_processor(out, 16, max_pixels)
    log.info("wrote a %s vision-language model to %s", kind, out)
    return out


def _qwen_tokenizer(out: Path, chat_template: str | None = None) -> tuple[int, dict[str, int]]:
    """The tokenizer with Qwen's image markup; its size, and the config's token ids."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(
        out, chat_template=chat_template, extra_special_tokens=QWEN_IMAGE_TOKENS
    )
    with open(out / "tokenizer.json") as f:
        ids = {t["content"]: t["id"] for t in json.load(f)["added_tokens"]}
    return vocab, {
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": ids["<|im_end|>"],
    }


def _qwen_text(kind: str, vocab: int, heads: int, kv_heads: int, head_dim: int = 32) -> dict:
    """What Qwen3.5's and Qwen3-VL's text configs share: 4 layers of 64 wide."""
    return {
        "model_type": f"{kind}_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }


def _qwen3_tower(kind: str, deepstack: list[int]) -> dict:
    """Qwen3.5's and Qwen3-VL's tower: 2 layers on 16-pixel patches, merged 2 x 2."""
    return {
        "model_type": kind,
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
        "in_channels": 3,
        "deepstack_visual_indexes": deepstack,
    }


def _qwen_processor(out: Path, patch: int, max_pixels: int) -> None:
    """transformers' Qwen2VLImageProcessor (its PIL twin: no torch)."""
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "size": {"shortest_edge": (2 * patch) ** 2, "longest_edge": max_pixels},
        **_PIXELS,
        "resample": 3,
    }
    with open(out / "preprocessor_config.json", "w") as f:
        json.dump(processor, f, indent=2)
