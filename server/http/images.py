"""Images in a request, for every dialect: decoded in order, or refused naming their part.

A dialect hands each image part to an ImageParts as it translates the
conversation and writes the text it gets back where the image stood: the
engine's placeholder (engine/vision/prompt.py) for a vision-language model.
An http(s) URL is a 400 unless the `allow_image_urls` setting is on; then it
waits in its place as a RemoteImage until `fetch_images` fetches it (httpx),
after translation and before the prompt is rendered. A text-only model
refuses a user's image with a 400 ("this model accepts text only") and reads
an image inside a tool's output as a text placeholder (ignored.omitted_media):
an agent's tool put it there, and a 400 would end the agent's session.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass, field
from typing import Any

import httpx

from flashserve.engine.vision.images import (
    Image,
    ImageError,
    decode_base64,
    decode_data_url,
    decode_image,
)
from flashserve.engine.vision.prompt import SENTINEL
from flashserve.server.http.errors import APIError, invalid_request
from flashserve.server.http.ignored import omitted_media

TEXT_ONLY = "images are not supported: this model accepts text only"
NOT_FETCHED = (
    "remote image URLs are not fetched by this server (its setting allow_image_urls, "
    "--allow-image-urls, is off); send the image as a data: URL (data:image/png;base64,...)"
)

MAX_REDIRECTS = 5
CHUNK = 1 << 16
# Object stores often label images as plain bytes; Pillow then decides.
UNTYPED = ("", "application/octet-stream", "binary/octet-stream")


@dataclass(frozen=True)
class FetchLimits:
    """How far the server goes for one URL (server/settings.py's image_url_*)."""

    max_bytes: int = 20_000_000
    timeout: float = 10.0  # seconds for the whole fetch, redirects included
    private: bool = False  # fetch from loopback, private and link-local addresses too


@dataclass(frozen=True)
class RemoteImage:
    """An http(s) image URL of a request, waiting to be fetched."""

    url: str
    param: str  # the request's part that holds it, for its 400


@dataclass(frozen=True)
class ImageLimits:
    """The settings an image part is checked against (server/settings.py)."""

    max_images: int = 8  # per request, every message's together
    max_pixels: int = 1_048_576  # larger images are downscaled to this many pixels
    fetch: FetchLimits | None = None  # None: http(s) URLs are refused (allow_image_urls off)


@dataclass
class ImageParts:
    """The images of one request, in the order they appear."""

    vision: Any  # the model's engine.vision.tower.VisionModel; None: a text-only model
    limits: ImageLimits = ImageLimits()
    images: list[Image | RemoteImage] = field(default_factory=list)  # Remote: until fetched

    def data_url(self, url: Any, param: str) -> str:
        """An image given as a URL (data:, or http(s) under allow_image_urls); its prompt
        text."""
        self.refuse_text_only(param)
        if not isinstance(url, str):
            raise invalid_request("an image URL must be a string", param)
        if is_remote(url):
            if self.limits.fetch is None:
                raise invalid_request(NOT_FETCHED, param, "invalid_image")
            # Fetched by fetch_images once the whole request is translated.
            return self._add(lambda: RemoteImage(url, param), param)
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
            image = decode()
            if isinstance(image, Image):
                _sized(self.vision, image)
            self.images.append(image)
        except ImageError as exc:
            raise invalid_request(str(exc), param, "invalid_image") from None
        return SENTINEL


def _sized(vision: Any, image: Image) -> None:
    """Raise ImageError when the model cannot make the image tokens (Qwen's processor
    refuses some shapes): the part's 400 here, not a failure while the prompt renders."""
    if vision is not None:
        vision.count(image)


# -- remote URLs (allow_image_urls) ----------------------------------------------------
#
# Translation is synchronous, so the fetches wait until the whole request is
# translated; then they run at once. Whatever goes wrong with a URL (refused,
# unreachable, slow, too large, not an image) is the client's 400 naming its
# part: the server only did what the client asked, so none of it is a 500.


class FetchError(Exception):
    """The URL gave no image: the message says why."""


def is_remote(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


async def fetch_images(images: list[Any], limits: ImageLimits, vision: Any = None) -> None:
    """A translated request's remote images (RemoteImage) made Images, in place: a
    400 naming the first part, in the request's order, whose URL gave no image (or one
    `vision`, the model's VisionModel, cannot take)."""
    pending = [(i, image) for i, image in enumerate(images) if isinstance(image, RemoteImage)]
    if not pending or limits.fetch is None:
        return
    fetch = limits.fetch
    hooks = {} if fetch.private else {"request": [_refuse_local]}
    async with httpx.AsyncClient(
        follow_redirects=True,
        max_redirects=MAX_REDIRECTS,
        timeout=httpx.Timeout(fetch.timeout),
        event_hooks=hooks,
    ) as client:
        fetched = await asyncio.gather(
            *(_fetch(client, remote, fetch, limits.max_pixels) for _, remote in pending),
            return_exceptions=True,
        )
    for (i, remote), result in zip(pending, fetched, strict=True):
        if isinstance(result, FetchError):
            raise invalid_request(
                f"the image at {remote.url[:200]!r} could not be fetched: {result}",
                remote.param,
                "image_fetch_failed",
            )
        if isinstance(result, Image):
            try:
                _sized(vision, result)
            except ImageError as exc:
                result = exc
        if isinstance(result, ImageError):
            raise invalid_request(str(result), remote.param, "invalid_image")
        if isinstance(result, BaseException):
            raise result
        images[i] = result


async def _refuse_local(request: httpx.Request) -> None:
    """Before each request, redirects included: a host that resolves to an address that
    is not public (loopback, private, link-local: the server's own network) is refused,
    so a client cannot make the server read what only the server can reach."""
    host = request.url.host
    try:
        addresses = {ipaddress.ip_address(host)}
    except ValueError:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, request.url.port or 443)
        except OSError as exc:
            raise FetchError(f"its host {host[:100]!r} does not resolve ({exc})") from None
        addresses = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}
    if any(not address.is_global for address in addresses):
        raise FetchError(
            f"its host {host[:100]!r} is on a loopback, private or link-local address, which "
            "this server does not fetch from (setting image_url_private)"
        )


async def _fetch(
    client: httpx.AsyncClient, remote: RemoteImage, limits: FetchLimits, max_pixels: int
) -> Image:
    try:
        # httpx's timeout bounds each read; a server trickling bytes is bounded here.
        async with asyncio.timeout(limits.timeout):
            raw = await _download(client, remote.url, limits.max_bytes)
    except (TimeoutError, httpx.TimeoutException):
        raise FetchError(f"no complete answer within {limits.timeout:g} s") from None
    except httpx.TooManyRedirects:
        raise FetchError(f"more than {MAX_REDIRECTS} redirects") from None
    except httpx.UnsupportedProtocol:
        raise FetchError("only http and https URLs are fetched") from None
    except httpx.HTTPError as exc:
        reason = str(exc) or type(exc).__name__
        raise FetchError(reason[:200]) from None
    # Decoding is Pillow's work on the CPU: off the event loop, as large images take long.
    return await asyncio.to_thread(decode_image, raw, max_pixels)


async def _download(client: httpx.AsyncClient, url: str, max_bytes: int) -> bytes:
    async with client.stream("GET", url, headers={"Accept": "image/*"}) as response:
        if response.status_code != 200:
            raise FetchError(f"HTTP {response.status_code} {response.reason_phrase}".strip())
        kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
        if not kind.startswith("image/") and kind not in UNTYPED:
            raise FetchError(f"its content type is {kind[:60]!r}, not an image")
        too_large = f"it is larger than {max_bytes} bytes (setting image_url_max_bytes)"
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_bytes:
            raise FetchError(too_large)
        body = bytearray()
        async for chunk in response.aiter_bytes(CHUNK):
            body += chunk
            if len(body) > max_bytes:
                raise FetchError(too_large)
        return bytes(body)
