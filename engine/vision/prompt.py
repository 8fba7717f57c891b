"""An image's tokens in a prompt.

A dialect puts SENTINEL in the message text where each image stands; after
the chat template has rendered, `expand` writes the model's own image
sequence in its place (what the model's processor writes: for Gemma 3,
"\\n\\n<start_of_image>" + the image token N times + "<end_of_image>\\n\\n").

Every image's placeholder tokens are the same ids, so a prompt cache keyed by
token ids would take one image's state for another's. `mark` therefore makes
the first placeholder token of each image a virtual id above any vocabulary
that carries the image's hash and the real id: the prompt cache, its disk
tier and every prefix match see two images as two different tokens, and the
next turn with the same image matches through it. `real_tokens` gives the ids
back before anything reaches the model or its logits processors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flashserve.engine.vision.images import Image, ImageError

# Written by the dialects; a client's text that holds it too makes the count
# wrong, and `expand` refuses the request.
SENTINEL = "\x00flashserve-image\x00"
ID_BITS = 20  # real token ids below 2**20 (Gemma's 262k and Qwen's 152k fit)
HASH_BITS = 40  # a collision needs two images of the same prefix: 1 in 10**12
VIRTUAL_BASE = 1 << (ID_BITS + HASH_BITS)


def virtual_id(image: Image, token_id: int) -> int:
    return VIRTUAL_BASE | (int(image.digest[: HASH_BITS // 4], 16) << ID_BITS) | token_id


def real_tokens(tokens: Sequence[int]) -> list[int]:
    """`tokens` with each virtual id made its real token id again."""
    mask = (1 << ID_BITS) - 1
    return [t & mask if t >= VIRTUAL_BASE else t for t in tokens]


@dataclass(frozen=True)
class ImageTokens:
    """How a model writes an image into its prompt."""

    before: str  # the markup before the placeholders
    placeholder: str  # the placeholder token's text: the positions the features fill
    after: str  # the markup after them
    token_id: int  # the placeholder's id

    def text(self, count: int) -> str:
        """The whole sequence an image of `count` placeholders becomes."""
        return f"{self.before}{self.placeholder * count}{self.after}"


@dataclass(frozen=True)
class ImagePrompt:
    """A request's images, in order, and the model's way of writing them."""

    images: Sequence[Image]
    tokens: ImageTokens
    # Placeholders per image: fixed for Gemma 3, the image's size for Qwen
    # (vision/tower.py VisionModel.count).
    counts: Sequence[int]

    def expand(self, text: str) -> str:
        """The rendered prompt with each SENTINEL made the model's image sequence."""
        parts = text.split(SENTINEL)
        if len(parts) - 1 != len(self.images):
            # The template dropped or repeated a message that held an image.
            raise ImageError(
                f"the chat template rendered {len(parts) - 1} of the request's "
                f"{len(self.images)} images"
            )
        texts = [self.tokens.text(n) for n in self.counts]
        return parts[0] + "".join(t + part for t, part in zip(texts, parts[1:], strict=True))

    def mark(self, ids: list[int]) -> list[int]:
        """The prompt's ids with each image's first placeholder made its virtual id."""
        runs = []
        i = 0
        while i < len(ids):
            if ids[i] == self.tokens.token_id:
                j = i
                while j < len(ids) and ids[j] == self.tokens.token_id:
                    j += 1
                runs.append((i, j))
                i = j
            else:
                i += 1
        lengths = [j - i for i, j in runs]
        if lengths != list(self.counts):
            # The client's text held the model's image markup of its own.
            raise ImageError(
                "the prompt's image tokens do not match its images (does the text hold "
                "the model's image markup?)"
            )
        out = list(ids)
        for (start, _), image in zip(runs, self.images, strict=True):
            out[start] = virtual_id(image, self.tokens.token_id)
        return out
