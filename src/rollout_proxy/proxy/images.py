"""The images a request sends, taken in (``proxy.intake``'s stages 5b and 6b): its ``http(s)`` image URLs
fetched before its conversation is normalized (only where ``--image-urls`` turns them on), then every image
it adds decoded with Pillow and checked before anything is stored.

Checked, each a 400 naming where the image was: its bytes decode (a truncated file does not), as PNG, JPEG,
WebP or GIF (a GIF's first frame is what is used), of the type an Anthropic ``media_type`` declares, within
``--max-image-bytes`` and ``--max-image-pixels``; and the request's conversation holds at most
``--max-images-per-request`` image parts. A URL is fetched within ``--image-url-timeout`` and
``--max-image-bytes`` (read as it comes, never past the bound), once per session while this worker keeps it
(a resent history names the same bytes: its messages keep their keys). What a session may store is the
store's bound (``state.store.ImageBound``), checked with the turn.
"""

from __future__ import annotations

import asyncio
import io
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from PIL import Image, UnidentifiedImageError

from rollout_proxy.bounded import BoundedCache
from rollout_proxy.errors import ImageRefused, TooManyImages
from rollout_proxy.settings import from_setting
from rollout_proxy.wire.images import IMAGE_TYPES, ImageBlob, ImageSet, RawImage, is_web_url

#: Pillow's names of the formats taken, and their MIME types (``wire.images.IMAGE_TYPES``)
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
#: formats told apart only to say which one a refused image has (opened for their header, never decoded)
OTHER_FORMATS = ("BMP", "TIFF", "ICO", "PPM", "TGA", "PCX", "QOI", "DDS", "JPEG2000", "PSD")
#: fetched URL images kept per session and URL, so a resent history does not fetch them again
MAX_FETCHED_BYTES = 64 * 1024 * 1024
MAX_FETCHED = 4096
#: URLs of one request fetched at once
FETCHES_AT_ONCE = 8
_CHUNK = 64 * 1024


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """The intake's part of the image settings (``app``: ``part(ImageLimits, settings)``)."""

    max_bytes: int = from_setting("max_image_bytes")
    max_pixels: int = from_setting("max_image_pixels")
    per_request: int = from_setting("max_images_per_request")
    urls: bool = from_setting("image_urls")
    url_timeout: float = from_setting("image_url_timeout")


def _taken() -> str:
    return ", ".join(mime.removeprefix("image/") for mime in IMAGE_TYPES)


def decode_image(raw: RawImage, limits: ImageLimits) -> ImageBlob:
    """``raw`` checked (see the module docstring) and described, or ``ImageRefused`` naming where it was."""
    size = len(raw.data)
    if size > limits.max_bytes:
        raise ImageRefused(
            f"the image has {size} bytes, more than the {limits.max_bytes} taken (--max-image-bytes)", param=raw.param
        )
    if raw.declared is not None and raw.declared not in IMAGE_TYPES:
        raise ImageRefused(f"an image of type {raw.declared!r} is not taken: {_taken()}", param=raw.param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # our own bound says how many pixels
            with Image.open(io.BytesIO(raw.data), formats=list(FORMATS)) as image:
                mime = FORMATS[str(image.format)]
                width, height = image.size
                if width * height > limits.max_pixels:
                    raise ImageRefused(
                        f"the image is {width}x{height} pixels, more than the {limits.max_pixels} taken "
                        "(--max-image-pixels)",
                        param=raw.param,
                    )
                if raw.strict and raw.declared != mime:
                    raise ImageRefused(f"the image is {mime}, not the {raw.declared} said", param=raw.param)
                image.load()  # every pixel decoded (a GIF: its first frame)
    except UnidentifiedImageError:
        other = _other_format(raw.data)
        found = f"it is {other}" if other else "it is not an image Pillow reads"
        raise ImageRefused(f"the image's format is not taken ({found}): {_taken()}", param=raw.param) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageRefused(f"the image has more pixels than the {limits.max_pixels} taken", param=raw.param) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageRefused(f"the image does not decode: {exc}", param=raw.param) from None
    return ImageBlob(raw.data, mime, width, height, raw.sha256)


def _other_format(data: bytes) -> str | None:
    """The format of an image that is not taken, when Pillow can tell it from the header."""
    try:
        with Image.open(io.BytesIO(data), formats=list(OTHER_FORMATS)) as image:
            return str(image.format)
    except Exception:
        return None


def _decode_all(fresh: list[RawImage], limits: ImageLimits) -> list[ImageBlob]:
    return [decode_image(raw, limits) for raw in fresh]


def image_urls(items: Any, key: str) -> list[tuple[str, str]]:
    """The ``http(s)`` image URLs of a body's list ``key`` (Chat ``messages``, Responses ``input``, the Messages
    API's ``messages``), each with where it is, in order: in a message's ``content`` parts, a Responses tool
    output's ``output`` parts, and a Messages ``tool_result``'s content."""
    found: list[tuple[str, str]] = []
    if type(items) is not list:
        return found
    for index, item in enumerate(items):
        if type(item) is dict:
            for field in ("content", "output"):
                _urls_in(item.get(field), f"{key}[{index}].{field}", found)
    return found


def _urls_in(parts: Any, where: str, found: list[tuple[str, str]]) -> None:
    if type(parts) is dict:  # a single part, as some datasets store it
        parts = [parts]
    if type(parts) is not list:
        return
    for index, part in enumerate(parts):
        if type(part) is not dict:
            continue
        at, kind, url, param = f"{where}[{index}]", part.get("type"), None, ""
        if kind == "image_url" and type(part.get("image_url")) is dict:
            url, param = part["image_url"].get("url"), f"{at}.image_url.url"
        elif kind == "input_image":
            url, param = part.get("image_url"), f"{at}.image_url"
        elif kind == "image" and type(part.get("source")) is dict and part["source"].get("type") == "url":
            url, param = part["source"].get("url"), f"{at}.source.url"
        elif kind == "tool_result":
            _urls_in(part.get("content"), f"{at}.content", found)
        if isinstance(url, str) and is_web_url(url):
            found.append((url, param))


class ImageIntake:
    """The app's image intake: its limits, and the HTTP client that fetches image URLs (opened on first use;
    whoever made this closes it)."""

    def __init__(self, limits: ImageLimits, *, http: aiohttp.ClientSession | None = None) -> None:
        self.limits = limits
        self._http = http
        self._own_http = http is None
        self._fetched: BoundedCache[tuple[str, str], bytes] = BoundedCache(
            max_entries=MAX_FETCHED, max_bytes=MAX_FETCHED_BYTES
        )

    async def close(self) -> None:
        if self._own_http and self._http is not None:
            await self._http.close()
        self._http = None

    def __len__(self) -> int:
        """Fetched images kept (for a resent history)."""
        return len(self._fetched)

    def expire(self, now: float) -> int:
        return self._fetched.expire(now)

    async def fetch(self, items: Any, key: str, *, session_id: str, until: float) -> Mapping[str, bytes] | None:
        """The bytes of the image URLs in the body's list (None: URLs are off, the normalizers refuse them)."""
        if not self.limits.urls:
            return None
        wanted: dict[str, str] = {}  # url -> where it is first
        fetched: dict[str, bytes] = {}
        for url, param in image_urls(items, key):
            held = self._fetched.get((session_id, url), until=until)
            if held is not None:
                fetched[url] = held
            else:
                wanted.setdefault(url, param)
        if wanted:
            gate = asyncio.Semaphore(FETCHES_AT_ONCE)

            async def one(url: str, param: str) -> bytes:
                async with gate:
                    return await self._fetch_one(url, param)

            results = await asyncio.gather(*(one(url, param) for url, param in wanted.items()), return_exceptions=True)
            for result in results:  # the first failure, in the order of the list
                if isinstance(result, BaseException):
                    raise result
            for url, data in zip(wanted, results, strict=True):
                assert isinstance(data, bytes)
                fetched[url] = data
                self._fetched.put((session_id, url), data, size=len(data) + len(url) + 200, until=until)
        return fetched

    async def _fetch_one(self, url: str, param: str) -> bytes:
        limits = self.limits
        if self._http is None:
            self._http = aiohttp.ClientSession()
        try:
            async with self._http.get(url, timeout=aiohttp.ClientTimeout(total=limits.url_timeout)) as response:
                if response.status != 200:
                    raise ImageRefused(f"fetching the image URL answered HTTP {response.status}", param=param)
                if response.content_length is not None and response.content_length > limits.max_bytes:
                    raise self._too_large(response.content_length, param)
                data = bytearray()
                async for chunk in response.content.iter_chunked(_CHUNK):
                    data += chunk
                    if len(data) > limits.max_bytes:
                        raise self._too_large(None, param)
                return bytes(data)
        except TimeoutError:
            raise ImageRefused(
                f"fetching the image URL took longer than {limits.url_timeout:g} s (--image-url-timeout)", param=param
            ) from None
        except aiohttp.ClientError as exc:
            raise ImageRefused(
                f"the image URL could not be fetched: {type(exc).__name__}: {exc}", param=param
            ) from None

    def _too_large(self, size: int | None, param: str) -> ImageRefused:
        said = f"{size} bytes" if size is not None else "more bytes"
        return ImageRefused(
            f"the image at this URL has {said}, more than the {self.limits.max_bytes} taken (--max-image-bytes)",
            param=param,
        )

    async def check(self, images: ImageSet, *, key: str) -> None:
        """The request's conversation within ``--max-images-per-request``, and each image it adds decoded and
        checked (off the event loop): the set then holds ``ImageBlob``s only. ``key``: the body's list."""
        images.urls = None  # fetched for this request's fold only
        limit = self.limits.per_request
        if images.parts > limit:
            at = limit - (images.parts - len(images.added))  # the first part past the bound, if this request's
            raise TooManyImages(
                f"the conversation holds {images.parts} image parts, more than the {limit} a request may "
                "(--max-images-per-request)",
                param=images.added[at] if 0 <= at < len(images.added) else key,
            )
        fresh, images.fresh, images.added = images.fresh, [], []
        if fresh:
            for blob in await asyncio.to_thread(_decode_all, fresh, self.limits):
                images.held[blob.sha256] = blob
