"""An image as a request carries it: decoded, checked, downscaled, hashed.

The server's dialects call `decode_image` on each image part before the
prompt is rendered, so an unreadable image is the client's 400 naming its
part, never a failure in the worker. Decoding needs Pillow, which the
`vision` extra brings; a text-only model never decodes an image.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass
from typing import Any

# Formats Pillow decodes that image APIs document (OpenAI, Anthropic).
FORMATS = ("PNG", "JPEG", "GIF", "WEBP")
DATA_URL = re.compile(r"data:(?P<mime>[\w.+/-]*)(?P<params>(;[^,;]*)*?);base64,", re.I)


class ImageError(ValueError):
    """The client's image cannot be used: the message says why."""


@dataclass(frozen=True)
class Image:
    """A decoded RGB image and the hash that keys its features and prompt states."""

    digest: str  # hex: the bytes and the pixel limit they were decoded under
    pixels: Any  # PIL.Image.Image, RGB, within the pixel limit
    width: int
    height: int


def decode_data_url(url: str, max_pixels: int) -> Image:
    """A `data:image/...;base64,` URL's image (ImageError when it is not one)."""
    match = DATA_URL.match(url)
    if match is None:
        if url.startswith(("http://", "https://")):
            raise ImageError(
                "remote image URLs are not fetched by this server; send the image as a "
                "data: URL (data:image/png;base64,...)"
            )
        raise ImageError("an image URL must be a data: URL with base64 data")
    return decode_base64(url[match.end() :], max_pixels)


def decode_base64(data: str, max_pixels: int) -> Image:
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image's data is not valid base64") from None
    return decode_image(raw, max_pixels)


def decode_image(raw: bytes, max_pixels: int) -> Image:
    """Decode `raw`; an image over `max_pixels` is downscaled (aspect kept) to fit."""
    try:
        from PIL import Image as PILImage
        from PIL import UnidentifiedImageError
    except ImportError:  # the vision extra brings Pillow; loading the model checked it
        raise ImageError("this server cannot decode images (Pillow is not installed)") from None
    try:
        image = PILImage.open(io.BytesIO(raw))
        kind = image.format
        if kind not in FORMATS:
            raise ImageError(
                f"image format {kind or 'unknown'} is not supported (use {', '.join(FORMATS)})"
            )
        # Pillow's own guard against decompression bombs: refuse what is absurd
        # before decoding it, downscale what is merely large.
        if image.width * image.height > 64 * max(max_pixels, 1 << 20):
            raise ImageError(f"the image is {image.width}x{image.height}: too large to decode")
        image.load()
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"the image cannot be read: {str(exc)[:200]}") from None
    image = image.convert("RGB")
    if image.width * image.height > max_pixels:
        scale = (max_pixels / (image.width * image.height)) ** 0.5
        size = (max(1, int(image.width * scale)), max(1, int(image.height * scale)))
        image = image.resize(size, PILImage.Resampling.BICUBIC)
    digest = hashlib.blake2b(raw, digest_size=16, person=b"flashserve-img")
    digest.update(str(max_pixels).encode())
    return Image(digest.hexdigest(), image, image.width, image.height)
