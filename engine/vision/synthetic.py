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

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from flashserve.engine.weights.synthetic import ARCHITECTURES, build_tokenizer

log = logging.getLogger(__name__)

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
    model = gemma3.Model(model_config)
    # As weights/synthetic.py: every parameter perturbed, so wrong weights show.
    model.update(tree_map(lambda p: p + 0.02 * mx.random.normal(p.shape), model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    processor = {
        "image_processor_type": "Gemma3ImageProcessor",
        "size": {"height": image_size, "width": image_size},
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
        "do_pan_and_scan": False,
        "resample": 2,
    }
    with open(out / "preprocessor_config.json", "w") as f:
        json.dump(processor, f, indent=2)
    log.info("wrote a gemma3 vision-language model to %s", out)
    return out
