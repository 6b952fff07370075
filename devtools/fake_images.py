"""The fake engine's images: vLLM 0.32's ``POST /inference/v1/generate`` with ``content_parts``, for an
Idefics3-style model (a tokenizer directory with a ``processor_config.json``).

As vLLM (``entrypoints/scale_out/token_in_token_out/serving.py``, ``multimodal/processing/processor.py``): each
``image_url`` part's data URL is decoded (Pillow reads it), the k-th ``<image>`` id of ``token_ids`` is
replaced by the k-th image's span, built as vLLM's ``Idefics3ProcessingInfo.get_image_repl`` builds it from
the processor config (splitting off: ``<fake_token_around_image><global-img>`` + ``<image>`` x
``image_seq_len`` + ``<fake_token_around_image>``, the text encoded without special tokens); more images than
markers is vLLM's error; markers past the images stay plain ids. With ``return_token_ids`` the answer
echoes the expanded ``prompt_token_ids`` and ``mm_placeholders``. Written apart from the proxy's own rule
(``rollout_proxy.tokenization.images``) so that a test against the fake checks that rule.

``FakeImages.span_for`` may be replaced by a test (an engine that expands differently: the proxy's drift
check must refuse its answer).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

_DATA_URL = re.compile(r"data:(?P<mime>[^;,]*);base64,(?P<data>.*)", re.DOTALL)


class ImageRequestError(Exception):
    """What vLLM answers with a 400 (its message)."""


@dataclass
class FakeImages:
    """An Idefics3-style model's image handling, from its processor config; ``received``: the images of every
    generate request, as (uuid, width, height) per request."""

    image_seq_len: int
    marker_id: int
    encode: Callable[[str], list[int]]
    received: list[list[tuple[str | None, int, int]]] = field(default_factory=list)
    span_for: Callable[[int, int], list[int]] | None = None  # (width, height) -> span: a test's other expansion

    @classmethod
    def load(cls, directory: Path, encode: Callable[[str], list[int]]) -> FakeImages | None:
        """None when the directory has no Idefics3 processor config (a text model: generate takes no images)."""
        path = directory / "processor_config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
        ids = encode("<image>")
        return cls(image_seq_len=int(config.get("image_seq_len", 169)), marker_id=ids[0], encode=encode)

    def span(self, width: int, height: int) -> list[int]:
        if self.span_for is not None:
            return self.span_for(width, height)
        fake, tag, image = "<fake_token_around_image>", "<global-img>", "<image>"
        return self.encode(fake + tag + image * self.image_seq_len + fake)

    def expand(self, token_ids: list[int], parts: list[Any]) -> tuple[list[int], list[dict[str, int]]]:
        """The prompt vLLM would run and its placeholder ranges; ``ImageRequestError`` as vLLM refuses."""
        sizes: list[tuple[str | None, int, int]] = []
        for index, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                raise ImageRequestError(f"content_parts[{index}]: only image_url parts are served here")
            match = _DATA_URL.fullmatch(str(part.get("url") or ""))
            if match is None:
                raise ImageRequestError(f"content_parts[{index}]: the fake takes base64 data URLs only")
            try:
                with Image.open(io.BytesIO(base64.b64decode(match["data"], validate=True))) as image:
                    image.load()
                    sizes.append((part.get("uuid"), image.width, image.height))
            except (binascii.Error, ValueError, OSError) as exc:
                raise ImageRequestError(f"content_parts[{index}]: the image does not decode: {exc}") from None
        markers = [at for at, token in enumerate(token_ids) if token == self.marker_id]
        if len(markers) < len(sizes):
            raise ImageRequestError(
                f"Expected there to be {len(sizes)} prompt placeholders corresponding to {len(sizes)} image items, "
                f"but instead found {len(markers)} prompt placeholders! Make sure the implementation of "
                "`_apply_hf_processor_main` and `_get_mm_fields_config` are consistent with each other."
            )
        self.received.append(sizes)
        expanded: list[int] = []
        ranges: list[dict[str, int]] = []
        start = 0
        for at, (_, width, height) in zip(markers, sizes, strict=False):
            expanded += token_ids[start:at]
            span = self.span(width, height)
            ranges.append({"offset": len(expanded), "length": len(span)})
            expanded += span
            start = at + 1
        expanded += token_ids[start:]
        return expanded, ranges
