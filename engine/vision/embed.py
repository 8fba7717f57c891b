"""A prompt chunk's input embeddings with the images' features merged in.

The worker prefills a prompt that holds images outside the batch, chunk by
chunk (generation/shared_prefill.py), passing each chunk's embeddings to the
mlx-lm model as `input_embeddings`: the token embeddings of the language
model that runs (resident or streamed), with each image's placeholder rows
replaced by its features. Each image is encoded once, when the first chunk
that holds it runs: one the prompt cache already covers never is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from flashserve.engine.vision.images import Image
from flashserve.engine.vision.prompt import VIRTUAL_BASE, real_tokens, virtual_id
from flashserve.engine.vision.tower import VisionModel

Embed = Callable[[int, Sequence[int]], mx.array]


def image_embedder(
    model: Any, vision: VisionModel | None, prompt: Sequence[int], images: Sequence[Image]
) -> Embed | None:
    """embed(start, chunk): prompt[start:start+len(chunk)]'s (1, L, hidden) embeddings;
    None for a prompt without images."""
    if not images or vision is None:
        return None
    embed_tokens = _token_embedding(model)
    token_id = vision.tokens.token_id
    by_id = {virtual_id(image, token_id): image for image in images}
    # Each position's (image, row): a run starts at a virtual id; placeholders follow.
    slots: dict[int, tuple[Image, int]] = {}
    current: Image | None = None
    row = 0
    for position, token in enumerate(prompt):
        if token >= VIRTUAL_BASE:
            current, row = by_id[token], 0
        elif token == token_id and current is not None:
            row += 1
        else:
            current = None
            continue
        slots[position] = (current, row)
    encoded: dict[str, mx.array] = {}  # an image's features, for every chunk it spans

    def embed(start: int, chunk: Sequence[int]) -> mx.array:
        h = embed_tokens(mx.array([real_tokens(chunk)]))
        here = [(p - start, slots[p]) for p in range(start, start + len(chunk)) if p in slots]
        if not here:
            return h
        for _, (img, _) in here:
            if img.digest not in encoded:
                encoded[img.digest] = vision.features(img)
        features = {img.digest: encoded[img.digest] for _, (img, _) in here}
        order = list(features)
        table = mx.concatenate([features[d] for d in order]).astype(h.dtype)
        offsets = dict(zip(order, [0, *[int(x) for x in _cumsum(features, order)]], strict=False))
        index = [0] * len(chunk)
        mask = [False] * len(chunk)
        for at, (img, r) in here:
            index[at], mask[at] = offsets[img.digest] + r, True
        rows = table[mx.array(index)][None]
        return mx.where(mx.array(mask)[None, :, None], rows, h)

    return embed


def _cumsum(features: dict[str, mx.array], order: list[str]) -> list[int]:
    total, out = 0, []
    for digest in order:
        total += features[digest].shape[0]
        out.append(total)
    return out


def _token_embedding(model: Any) -> Any:
    """The language model's token embedding (mlx-lm nests it per architecture)."""
    for owner in (getattr(model, "language_model", None), model):
        inner = getattr(owner, "model", None)
        if inner is not None and hasattr(inner, "embed_tokens"):
            return inner.embed_tokens
    raise TypeError(f"{type(model).__name__} has no token embedding to merge images into")
