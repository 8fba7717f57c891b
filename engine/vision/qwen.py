"""Qwen's images (Qwen3.5, Qwen2.5-VL, Qwen3-VL and their MoE twins), through mlx-vlm.

An image becomes "<|vision_start|>" + one "<|image_pad|>" per token +
"<|vision_end|>", as Qwen's processor writes it. Unlike Gemma 3 the count
follows the image's size: the image processor (transformers') resizes it to
a multiple of patch x merge pixels within its pixel bounds, the tower cuts
it into `grid` patches (t, h, w) and merges merge x merge of them into one
token. The tokens' positions are M-RoPE's (vision/mrope.py), computed by
mlx-vlm's language model from the prompt and the grids.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from flashserve.engine.vision.images import Image, ImageError
from flashserve.engine.vision.mrope import Positions
from flashserve.engine.vision.prompt import ImageTokens, real_tokens

ARCHITECTURES = ("qwen3_5", "qwen3_5_moe", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# Whose tower's deepstack features join the language model's first layers (Qwen3.5
# has a deepstack in its config that its model does not use: mlx-vlm drops it).
DEEPSTACK = ("qwen3_vl", "qwen3_vl_moe")


def image_tokens(config: Any, tokenizer: Any) -> ImageTokens:
    start, pad, end = tokenizer.convert_ids_to_tokens(
        [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
    )
    return ImageTokens(start, pad, end, config.image_token_id)


class QwenImages:
    """A Qwen model's image side: processing, tower, positions."""

    def __init__(self, kind: str, model: Any, processor: Any) -> None:
        self.model, self.processor = model, processor
        vision = model.config.vision_config
        self.merge = int(vision.spatial_merge_size)
        # Deepstack layers: the features carry one more (tokens, hidden) part for each.
        deepstack = getattr(vision, "deepstack_visual_indexes", None) or []
        self.deepstack = len(deepstack) if kind in DEEPSTACK else 0
        # The processor's own sizing (transformers' smart_resize, in its module).
        self._resize = sys.modules[type(processor).__module__].smart_resize
        self.rotary = _rotary(model)

    def grid(self, image: Image) -> tuple[int, int, int]:
        """The patches (t, h, w) the processor cuts the image into, from its size alone
        (as the processor's get_number_of_image_patches counts them): counting a
        request's tokens touches no pixel, as the server renders it on its event loop."""
        processor = self.processor
        patch, merge = int(processor.patch_size), int(processor.merge_size)
        try:
            height, width = self._resize(
                image.height,
                image.width,
                patch * merge,
                min_pixels=processor.size["shortest_edge"],
                max_pixels=processor.size["longest_edge"],
            )
        except ValueError as exc:  # an aspect ratio past 200: the client's image
            raise ImageError(f"the model's image processor cannot take the image: {exc}") from None
        return 1, height // patch, width // patch

    def count(self, image: Image) -> int:
        t, h, w = self.grid(image)
        return t * (h // self.merge) * (w // self.merge)

    def features(self, image: Image) -> mx.array:
        """(tokens, hidden): the tower's merged patches (mlx-vlm's get_input_embeddings)."""
        processed = self.processor(images=[image.pixels], return_tensors="np")
        pixels, grid = np.asarray(processed["pixel_values"]), self.grid(image)
        cut = tuple(int(v) for v in np.asarray(processed["image_grid_thw"])[0])
        if cut != grid:  # the prompt holds grid's tokens: other features cannot fill them
            raise ImageError(f"the image processor cut the image into {cut} patches, not {grid}")
        tower = self.model.vision_tower
        dtype = tower.patch_embed.proj.weight.dtype
        out = tower(mx.array(pixels).astype(dtype), mx.array([grid]))
        if not isinstance(out, tuple):  # Qwen2.5-VL: the rows alone
            return out
        rows, deepstack = out
        if not self.deepstack:
            return rows
        # Qwen3-VL: each deepstack layer's rows beside the tokens' (vision/embed.py splits).
        return mx.concatenate([rows, *deepstack[: self.deepstack]], axis=-1)

    def positions(self, prompt: Sequence[int], images: Sequence[Image]) -> Positions:
        """The prompt's M-RoPE positions, as mlx-vlm's language model computes them."""
        ids = mx.array([real_tokens(prompt)])
        grids = mx.array([self.grid(i) for i in images]) if images else None
        table, _ = self.model.language_model.get_rope_index(ids, grids)
        table = np.asarray(table)
        if table.ndim == 2:  # no image in the prompt: one position per token
            table = np.broadcast_to(table, (3, *table.shape))
        return Positions(table[:, 0, :])


def _rotary(model: Any) -> Any:
    """mlx-vlm's M-RoPE of its language model's attention (the model's section layout)."""
    for _, module in model.language_model.named_modules():
        rotary = getattr(module, "rotary_emb", None)
        if rotary is not None and hasattr(rotary, "apply_rotary"):
            return rotary
    raise TypeError(f"{type(model).__module__}: no M-RoPE rotary embedding found")
