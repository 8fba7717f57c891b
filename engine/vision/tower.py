"""The vision side of a vision-language model directory, through mlx-vlm.

mlx-vlm builds the architecture's model from config.json (its own config
normalization, weight sanitizing and quantization); only the vision tower
and projector are given weights and evaluated. The language model mlx-vlm
builds alongside is never evaluated (MLX initializes lazily), so it costs no
memory: the language model that runs is the engine's mlx-lm model. For Qwen it
still lends its configuration's arithmetic: the prompt's M-RoPE positions and
the rotary embedding that applies them (vision/qwen.py).
"""

from __future__ import annotations

import glob
import logging
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from flashserve.engine.vision import mrope, qwen
from flashserve.engine.vision.images import Image
from flashserve.engine.vision.prompt import ImagePrompt, ImageTokens
from flashserve.engine.weights.layout import LANGUAGE_PREFIXES, VISION_FILE

log = logging.getLogger(__name__)

INSTALL = "pip install 'flashserve[vision]'"
# Architectures whose language model mlx-lm runs with `input_embeddings`: Gemma 3
# with plain positions, Qwen's with M-RoPE's given through the caches' offsets
# (vision/mrope.py). Why others are left out: docs/guides/images.md.
ARCHITECTURES = ("gemma3", *qwen.ARCHITECTURES)


class VisionError(Exception):
    """A vision model that cannot be served (the message says what to do)."""


def is_vision_model(config: dict) -> bool:
    return bool(config.get("vision_config"))


def load_vision(path: Path | None, config: dict, tokenizer: Any) -> VisionModel | None:
    """The vision side of the model at `path`, or None for a text-only model."""
    if not is_vision_model(config):
        return None
    kind = config.get("model_type")
    if kind not in ARCHITECTURES:
        raise VisionError(
            f"{kind} is a vision-language model whose images flashserve does not support "
            f"yet (supported: {', '.join(ARCHITECTURES)})"
        )
    if path is None or not path.is_dir():
        raise VisionError("a vision-language model must be a model directory")
    try:
        import mlx_vlm  # noqa: F401
        from transformers import AutoImageProcessor
    except ImportError as exc:
        raise VisionError(
            f"{path.name} is a vision-language model ({kind}); serving it needs the vision "
            f"extra: {INSTALL} ({exc})"
        ) from None
    return VisionModel(path, config, tokenizer, AutoImageProcessor)


class VisionModel:
    """Tower, projector and image processor of a vision-language model.

    Features are not kept between requests: the prompt cache keeps the states
    they made (keyed by the image's hash, vision/prompt.py), so an image the next
    turn resends is not encoded again, and one it does not is not held."""

    def __init__(self, path: Path, config: dict, tokenizer: Any, processor_class: Any):
        started = time.perf_counter()
        self.kind = config["model_type"]
        self.model, self.config = _load_parts(path)
        params = [*self.model.vision_tower.parameters().values()]
        if (projector := getattr(self.model, "multi_modal_projector", None)) is not None:
            params.append(projector.parameters())  # Qwen's merger is the tower's own
        mx.eval(params)
        self.weight_bytes = sum(a.nbytes for _, a in tree_flatten(params))
        self.processor = processor_class.from_pretrained(str(path), backend="pil")
        # Qwen: its images' processing, tower and M-RoPE positions; None for Gemma 3.
        self.qwen = (
            qwen.QwenImages(self.kind, self.model, self.processor)
            if self.kind in qwen.ARCHITECTURES
            else None
        )
        if self.qwen is not None:
            self.tokens = qwen.image_tokens(self.config, tokenizer)
        else:
            self.tokens = _gemma3_tokens(self.config, tokenizer)
        self._lock = threading.Lock()  # the counters: /metrics reads them
        self.encodes = 0  # images run through the tower (a cached one is not)
        self.encode_seconds = 0.0
        log.info("vision tower of %s loaded in %.1fs", self.kind, time.perf_counter() - started)

    def attach(self, layers: list[Any]) -> None:
        """Give the language model's attention layers the images' positions (M-RoPE)."""
        if self.qwen is None:
            return
        if not mrope.install(layers, self.qwen.rotary):
            raise VisionError(f"{self.kind}: no attention layer with a rope to give positions")
        mrope.install_deepstack(layers, self.qwen.deepstack)

    def count(self, image: Image) -> int:
        """The image's placeholder tokens in a prompt."""
        if self.qwen is not None:
            return self.qwen.count(image)
        return int(self.config.text_config.mm_tokens_per_image)

    def positions(self, prompt: list[int], images: list[Image]) -> mrope.Positions | None:
        """The prompt's M-RoPE positions (Qwen); None where positions are plain."""
        return self.qwen.positions(prompt, images) if self.qwen is not None else None

    def report(self) -> dict[str, float]:
        """For /memory: the tower's resident weights and what it encoded."""
        with self._lock:
            return {
                "weight_bytes": self.weight_bytes,
                "images_encoded": self.encodes,
                "encode_seconds": round(self.encode_seconds, 6),
            }

    def prompt(self, images: list[Image]) -> ImagePrompt:
        return ImagePrompt(images, self.tokens, [self.count(i) for i in images])

    def features(self, image: Image) -> mx.array:
        """(tokens per image, hidden) rows that take the image's placeholders' place."""
        started = time.perf_counter()
        if self.qwen is not None:
            rows = self.qwen.features(image)
        else:
            pixels = self.processor(images=[image.pixels], return_tensors="np")["pixel_values"]
            rows = self._gemma3(mx.array(np.asarray(pixels)))
        mx.eval(rows)
        with self._lock:
            self.encodes += 1
            self.encode_seconds += time.perf_counter() - started
        return rows

    def _gemma3(self, pixels: mx.array) -> mx.array:
        # mlx-vlm's Gemma 3 get_input_embeddings, the image half: tower, projector,
        # then divided by sqrt(hidden) (the language model multiplies every embedding back).
        model = self.model
        dtype = model.vision_tower.vision_model.embeddings.patch_embedding.weight.dtype
        hidden, _, _ = model.vision_tower(
            pixels.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True
        )
        rows = model.multi_modal_projector(hidden)
        return (rows / (self.config.hidden_size**0.5))[0]


def _gemma3_tokens(config: Any, tokenizer: Any) -> ImageTokens:
    """Gemma3Processor's full_image_sequence, from the model's own token ids."""
    image, boi, eoi = (
        tokenizer.convert_ids_to_tokens(i)
        for i in (config.image_token_index, _config_id(config, "boi"), _config_id(config, "eoi"))
    )
    return ImageTokens(f"\n\n{boi}", image, f"{eoi}\n\n", config.image_token_index)


def _config_id(config: Any, name: str) -> int:
    # Gemma 3's checkpoints name them in config.json; mlx-vlm's config may not keep them.
    defaults = {"boi": 255999, "eoi": 256000}
    return int(getattr(config, f"{name}_token_index", None) or defaults[name])


def _load_parts(path: Path) -> tuple[Any, Any]:
    """mlx-vlm's model of `path` with only its vision weights loaded (lazily)."""
    from mlx_vlm.utils import (
        get_model_and_args,
        load_config,
        load_model_weights,
        sanitize_weights,
        update_module_configs,
    )

    config = load_config(path)
    model_class, _ = get_model_and_args(config=config, model_path=path)
    config.setdefault("text_config", {})
    config.setdefault("vision_config", {})
    model_config = model_class.ModelConfig.from_dict(config)
    model_config = update_module_configs(
        model_config, model_class, config, ["text", "vision", "perceiver", "projector", "audio"]
    )
    model = model_class.Model(model_config)
    weights = _vision_weights(path)
    weights = sanitize_weights(model, weights)
    if hasattr(model_class, "VisionModel"):
        weights = sanitize_weights(model_class.VisionModel, weights, model_config.vision_config)
    model = load_model_weights(model, config, weights, path, lazy=True, strict=False)
    # strict=False lets the language model go without weights; the vision side may not.
    vision = {k for k, _ in tree_flatten(model.parameters()) if not k.startswith("language_model.")}
    if missing := sorted(vision - set(weights)):
        raise VisionError(f"{path}: the vision weights lack {', '.join(missing[:3])}")
    for key in ("boi_token_index", "eoi_token_index"):
        if key in config:
            setattr(model_config, key, config[key])
    return model, model_config


def _vision_weights(path: Path) -> dict[str, mx.array]:
    """The checkpoint's tensors outside the language model (lazily mapped)."""
    prepared = path / VISION_FILE
    files = (
        [str(prepared)] if prepared.is_file() else sorted(glob.glob(str(path / "*.safetensors")))
    )
    weights: dict[str, mx.array] = {}
    for file in files:
        tensors = mx.load(file)
        assert isinstance(tensors, dict)
        weights.update({k: v for k, v in tensors.items() if not k.startswith(LANGUAGE_PREFIXES)})
    return weights
