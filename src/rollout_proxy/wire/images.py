"""Images in the normal form: a content part ``{"type": "image", "image": "<sha256 hex of its bytes>"}``.

The three APIs send an image as a Chat ``image_url`` part, a Responses ``input_image`` part or a Messages
``image`` block, inline (a ``data:`` URL, a base64 source) or as an ``http(s)`` URL. The normalizers
(``wire.messages``, ``wire.responses``, ``wire.anthropic``) hand each one to the conversation's
``ImageSet``, which decodes it (a URL's bytes are those the proxy fetched for the request: ``urls``), names it
by the sha256 of its bytes and keeps it by that name: the message's canonical key then holds the hash, so
the same image sent as a data URL or as a base64 block is the same message. What a request added
(``fresh``) is not checked here (the proxy decodes it with Pillow before anything is stored, and makes an
``ImageBlob`` of it); without an ``ImageSet`` (the SDK's own bookkeeping) an image is only named: by its
hash, or a URL by itself (``{"type": "image", "url": ...}``, a view the proxy never stores).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout_proxy.wire.errors import WireFormatError

IMAGE_PART = "image"
#: the code of an image's refusal in the server's answer (``errors.ImageRefused``'s)
INVALID_IMAGE = "invalid_image"
#: the formats an image may have, by the MIME type that names them (a GIF's first frame is what is used)
IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")
_DATA_URL = re.compile(r"data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<data>.*)", re.DOTALL)
_WEB = ("http://", "https://")


@dataclass(frozen=True, slots=True)
class ImageBlob:
    """An image as the session's image store keeps it: its bytes, the MIME type of their format, its size in
    pixels, and the sha256 (hex) of the bytes that names it."""

    data: bytes
    mime: str
    width: int
    height: int
    sha256: str


@dataclass(frozen=True, slots=True)
class RawImage:
    """An image a request sent, decoded and named, not checked yet: ``declared`` is the MIME type it was sent
    with (None: not said), ``strict`` whether its bytes must be of that type (Anthropic's ``media_type``)."""

    data: bytes
    sha256: str
    declared: str | None
    strict: bool
    param: str  # where it was in the request (the first place, when it is there twice)


def image_part(sha256: str) -> dict[str, str]:
    return {"type": IMAGE_PART, "image": sha256}


def image_hashes(messages: Iterable[Mapping[str, Any]]) -> list[str]:
    """The hashes of the images ``messages`` hold, in order, each once."""
    found: dict[str, None] = {}
    for message in messages:
        content = message.get("content")
        if type(content) is list:
            found.update((part["image"], None) for part in content if part.get("type") == IMAGE_PART)
    return list(found)


def count_image_parts(messages: Iterable[Mapping[str, Any]]) -> int:
    """How many image parts ``messages`` hold (an image sent twice counts twice: the policy sees it twice)."""
    return sum(
        1
        for message in messages
        if type(content := message.get("content")) is list
        for part in content
        if part.get("type") == IMAGE_PART
    )


@dataclass(slots=True)
class ImageSet:
    """The images of one conversation by hash (``held``: checked ``ImageBlob``s, and this request's ``fresh``
    ``RawImage``s until they are), how many image parts it holds, and, for the request that folds into it now,
    where the parts it added are (``added``) and the bytes of the URL images it fetched (``urls``; None: URLs
    are refused)."""

    held: dict[str, ImageBlob | RawImage] = field(default_factory=dict)
    fresh: list[RawImage] = field(default_factory=list)
    parts: int = 0
    urls: Mapping[str, bytes] | None = None
    added: list[str] = field(default_factory=list)

    def extended(self) -> ImageSet:
        """A set that goes on from this one (another request's: its fresh images and URLs are its own)."""
        return ImageSet(dict(self.held), [], self.parts)

    def upto(self, messages: Iterable[Mapping[str, Any]]) -> ImageSet:
        """The set of a conversation cut to ``messages`` (a start of this one's)."""
        return ImageSet(dict(self.held), [], count_image_parts(messages))

    def checked(self) -> dict[str, ImageBlob]:
        """The images checked (``ImageBlob``s: after the proxy's intake, all of them), by hash."""
        return {sha: image for sha, image in self.held.items() if isinstance(image, ImageBlob)}

    @property
    def nbytes(self) -> int:
        return sum(len(image.data) for image in self.held.values())

    def inline(self, data: bytes, declared: str | None, param: str, *, strict: bool = False) -> dict[str, str]:
        """The part of an image sent inline (its bytes decoded)."""
        sha256 = hashlib.sha256(data).hexdigest()
        self.parts += 1
        self.added.append(param)
        if sha256 not in self.held:
            raw = RawImage(data, sha256, declared, strict, param)
            self.held[sha256] = raw
            self.fresh.append(raw)
        return image_part(sha256)

    def url(self, url: str, param: str) -> dict[str, str]:
        """The part of an image sent by ``http(s)`` URL: its bytes as fetched for this request."""
        if self.urls is None:
            raise WireFormatError(
                "image URLs are not fetched by this proxy (an operator turns them on with --image-urls): send the "
                "image inline, base64-encoded (a data: URL, or a base64 source)",
                param=param,
                code=INVALID_IMAGE,
            )
        data = self.urls.get(url)
        if data is None:
            raise WireFormatError("this image URL was not fetched for the request", param=param, code=INVALID_IMAGE)
        return self.inline(data, None, param)


def decode_base64(text: str, *, param: str) -> bytes:
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise WireFormatError("the image's base64 data does not decode", param=param, code=INVALID_IMAGE) from None
    if not data:
        raise WireFormatError("the image's data is empty", param=param, code=INVALID_IMAGE)
    return data


def data_url(url: str, *, param: str) -> tuple[str | None, bytes]:
    """A ``data:`` URL's declared MIME type (None: not said) and its decoded bytes."""
    match = _DATA_URL.fullmatch(url)
    if match is None or "base64" not in [each.strip().lower() for each in match["params"].split(";")]:
        raise WireFormatError(
            "an image data URL must be base64: data:image/png;base64,...", param=param, code=INVALID_IMAGE
        )
    mime = match["mime"].strip().lower() or None
    return mime, decode_base64(match["data"], param=param)


def is_web_url(url: str) -> bool:
    return url[:8].lower().startswith(_WEB)


def url_image(url: Any, images: ImageSet | None, *, param: str) -> dict[str, str]:
    """The part of an image given by URL (OpenAI's ``image_url``): a ``data:`` URL, or an ``http(s)`` one."""
    if not isinstance(url, str) or not url:
        raise WireFormatError(
            "an image needs its URL as a string: a data: URL or an http(s) URL", param=param, code=INVALID_IMAGE
        )
    if url[:5].lower() == "data:":
        mime, data = data_url(url, param=param)
        return inline_image(data, mime, images, param=param)
    if not is_web_url(url):
        raise WireFormatError(
            f"an image URL must be a data: URL or an http(s) URL, not {url[:24]!r}", param=param, code=INVALID_IMAGE
        )
    if images is None:
        return {"type": IMAGE_PART, "url": url}
    return images.url(url, param)


def inline_image(
    data: bytes, declared: str | None, images: ImageSet | None, *, param: str, strict: bool = False
) -> dict[str, str]:
    if images is None:
        return image_part(hashlib.sha256(data).hexdigest())
    return images.inline(data, declared, param, strict=strict)
