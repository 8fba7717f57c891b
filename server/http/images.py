"""Images in a request, for every dialect: decoded in order, or refused naming their part.

A dialect hands each image part to an ImageParts as it translates the
conversation and writes the text it gets back where the image stood: the
engine's placeholder (engine/vision/prompt.py) for a vision-language model.
A text-only model refuses a user's image with a 400 ("this model accepts text
only") and reads an image inside a tool's output as a text placeholder
(ignored.omitted_media): an agent's tool put it there, and a 400 would end
the agent's session.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flashserve.engine.vision.images import Image, ImageError, decode_base64, decode_data_url
from flashserve.engine.vision.prompt import SENTINEL
from flashserve.server.http.errors import APIError, invalid_request
from flashserve.server.http.ignored import omitted_media

TEXT_ONLY = "images are not supported: this model accepts text only"


@dataclass(frozen=True)
class ImageLimits:
    """The settings an image part is checked against (server/settings.py)."""

    max_images: int = 8  # per request, every message's together
    max_pixels: int = 1_048_576  # larger images are downscaled to this many pixels


@dataclass
class ImageParts:
    """The images of one request, in the order they appear."""

    vision: Any  # the model's engine.vision.tower.VisionModel; None: a text-only model
    limits: ImageLimits = ImageLimits()
    images: list[Image] = field(default_factory=list)

    def data_url(self, url: Any, param: str) -> str:
        """An image given as a URL (only data: URLs are read); its prompt text."""
        self.refuse_text_only(param)
        if not isinstance(url, str):
            raise invalid_request("an image URL must be a string", param)
        return self._add(lambda: decode_data_url(url, self.limits.max_pixels), param)

    def source(self, source: dict[str, Any], param: str) -> str:
        """An Anthropic image block's `source`; its prompt text."""
        self.refuse_text_only(param)
        kind = source.get("type")
        if kind == "url":
            return self.data_url(source.get("url"), f"{param}.url")
        if kind != "base64" or not isinstance(source.get("data"), str):
            raise invalid_request(
                f"an image source must be base64 data (type 'base64'), not {str(kind)[:40]!r}",
                f"{param}.type",
            )
        return self._add(lambda: decode_base64(source["data"], self.limits.max_pixels), param)

    def in_tool_output(self, add: Any, where: str, kind: str = "image") -> str:
        """A tool output's image: `add()` for a vision model, else the placeholder."""
        return omitted_media(where, kind) if self.vision is None else add()

    def refuse_text_only(self, param: str) -> None:
        """A user's image sent to a text-only model: its 400."""
        if self.vision is None:
            raise APIError(400, TEXT_ONLY, param=param, code="unsupported_content")

    def _add(self, decode: Any, param: str) -> str:
        if len(self.images) >= self.limits.max_images:
            raise invalid_request(
                f"at most {self.limits.max_images} images per request (setting max_images)",
                param,
                "too_many_images",
            )
        try:
            self.images.append(decode())
        except ImageError as exc:
            raise invalid_request(str(exc), param, "invalid_image") from None
        return SENTINEL
