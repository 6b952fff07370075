"""A model's image placeholders: how its multimodal processor expands the image marker the chat template
renders, exactly as vLLM 0.32 does, so the proxy's tokens are the tokens the policy saw.

The chat template renders one marker per image part (Idefics3: ``<image>``). vLLM never takes a prompt's
placeholder spans as given: its processor replaces the k-th marker id of the prompt by the k-th image's
span, every time (``BaseMultiModalProcessor.apply``; research notes: ``/inference/v1/generate``). So the proxy

- expands each marker of a new render into the image's span (``expand``), recording where each one is
  (``records.ImageSpan``): the tree keeps the expanded ids, as the policy saw them;
- sends the engine its prompt with each span collapsed back to the one marker (``collapse``), with every
  image of the prompt in order, and checks that the engine's echo of the expanded prompt and of the spans
  equals its own (``core.turns``).

One rule per model family (``RULES``, by the ``model_type`` of the checkpoint's ``config.json``), read from the
processor config beside the model's tokenizer (``processor_config.json``, the image processor's fields there
or in ``preprocessor_config.json``). A model without a rule here takes no images, and a rule the proxy cannot
follow token for token is refused in words (Idefics3 with image splitting on: each image's span then depends
on its size through the resize, which is vLLM's to compute).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rollout_proxy.records import ImageSpan
from rollout_proxy.wire.images import IMAGE_PART, ImageBlob

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")

Encode = Callable[[str], Sequence[int]]


class ImagesUnavailable(Exception):
    """This model takes no images through the proxy; the message says why (for the client's 400)."""


@dataclass(frozen=True, slots=True)
class ImagePlaceholders:
    """One model's rule: the ``marker`` text its template renders per image (one token, ``marker_id``) and
    the ids it expands to (``span``). Every image expands to the same span here: the only rules the proxy
    follows are those whose span does not depend on the image (sizes and hashes are recorded all the same)."""

    model_type: str
    marker: str
    marker_id: int
    span_ids: np.ndarray  # int32

    def span(self, image: ImageBlob) -> np.ndarray:
        return self.span_ids

    def markers(self, ids: np.ndarray) -> np.ndarray:
        """Where the marker is in ``ids``."""
        return np.flatnonzero(ids == self.marker_id)

    def expand(self, ids: np.ndarray, images: Sequence[ImageBlob]) -> tuple[np.ndarray, tuple[ImageSpan, ...]]:
        """``ids`` (a render: one marker per image, in order) with the k-th marker replaced by ``images[k]``'s
        span, and the spans (positions in the result). ``ValueError`` when the markers are not one per image."""
        at = self.markers(ids)
        if len(at) != len(images):
            raise ValueError(f"{len(at)} image marker(s) {self.marker!r} for {len(images)} image(s)")
        if not images:
            return ids, ()
        parts: list[np.ndarray] = []
        spans: list[ImageSpan] = []
        start = 0
        length = 0  # of the result so far
        for position, image in zip(at.tolist(), images, strict=True):
            parts.append(ids[start:position])
            length += position - start
            span = self.span(image)
            spans.append(ImageSpan(length, len(span), image.sha256, image.width, image.height, len(image.data)))
            parts.append(span)
            length += len(span)
            start = position + 1
        parts.append(ids[start:])
        return np.concatenate(parts).astype(np.int32, copy=False), tuple(spans)

    def collapse(self, ids: np.ndarray, spans: Sequence[ImageSpan]) -> np.ndarray:
        """``ids`` with each span (positions in ``ids``, in order) replaced by the one marker: what the engine is
        sent. ``ValueError`` when a span is not this model's span there, or when the marker stands anywhere
        else in ``ids`` (the engine would take it for an image)."""
        parts: list[np.ndarray] = []
        start = 0
        marker = np.asarray([self.marker_id], dtype=np.int32)
        for span in spans:
            if span.start < start or not np.array_equal(ids[span.start : span.end], self.span_ids):
                raise ValueError(f"the tokens at {span.start}..{span.end} are not an image's placeholder span")
            parts += [ids[start : span.start], marker]
            start = span.end
        parts.append(ids[start:])
        collapsed = np.concatenate(parts).astype(np.int32, copy=False)
        stray = len(self.markers(collapsed)) - len(spans)
        if stray:
            raise ValueError(
                f"the conversation holds the image marker {self.marker!r} {stray} time(s) where no image is: the "
                "engine would take it for an image"
            )
        return collapsed


def image_part_hashes(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The hash of each image part of ``messages``, in order, an image sent twice twice (the template renders a
    marker for each)."""
    return [
        part["image"]
        for message in messages
        if type(content := message.get("content")) is list
        for part in content
        if isinstance(part, dict) and part.get("type") == IMAGE_PART
    ]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ImagesUnavailable(f"the model's {path.name} cannot be read: {exc}") from None
    return data if isinstance(data, dict) else None


def _one_token(text: str, encode: Encode) -> int:
    ids = list(encode(text))
    if len(ids) != 1:
        raise ImagesUnavailable(f"the model's tokenizer has no single token {text!r} (it encodes to {ids})")
    return int(ids[0])


def _idefics3(processor: Mapping[str, Any], image_processor: Mapping[str, Any], encode: Encode) -> ImagePlaceholders:
    """vLLM's ``Idefics3ProcessingInfo.get_image_repl`` without splitting: ``<fake_token_around_image>``
    ``<global-img>`` ``<image>`` x ``image_seq_len`` ``<fake_token_around_image>``, the text encoded as vLLM
    encodes a replacement (without special tokens)."""
    if image_processor.get("do_image_splitting", True) is not False:
        raise ImagesUnavailable(
            "this Idefics3 model splits images into tiles (do_image_splitting is not false in its processor "
            "config): each image's tokens then depend on its size, which the proxy does not compute; serve it "
            'with "do_image_splitting": false'
        )
    seq_len = processor.get("image_seq_len", 169)  # transformers' Idefics3Processor default
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        raise ImagesUnavailable(f"the model's image_seq_len {seq_len!r} is not a positive integer")
    marker, fake, tag = "<image>", "<fake_token_around_image>", "<global-img>"
    marker_id = _one_token(marker, encode)
    fake_id, tag_id = _one_token(fake, encode), _one_token(tag, encode)
    span = list(encode(fake + tag + marker * seq_len + fake))
    if span != [fake_id, tag_id, *[marker_id] * seq_len, fake_id]:
        raise ImagesUnavailable("the model's tokenizer does not encode an Idefics3 image span token by token")
    return ImagePlaceholders("idefics3", marker, marker_id, np.asarray(span, dtype=np.int32))


#: model_type -> the rule built from (processor config, image processor config, the tokenizer's encode)
RULES: dict[str, Callable[[Mapping[str, Any], Mapping[str, Any], Encode], ImagePlaceholders]] = {
    "idefics3": _idefics3,
}


def load_placeholders(directory: Path, encode: Encode) -> ImagePlaceholders:
    """The rule of the model whose files are in ``directory`` (``encode``: its tokenizer, as vLLM encodes text);
    ``ImagesUnavailable`` saying why there is none."""
    config = _read_json(directory / "config.json") or {}
    model_type = config.get("model_type")
    rule = RULES.get(model_type) if isinstance(model_type, str) else None
    if rule is None:
        taken = ", ".join(sorted(RULES))
        raise ImagesUnavailable(
            f"the proxy has no image placeholder rule for this model (model_type {model_type!r}; it has: {taken})"
        )
    processor = _read_json(directory / PROCESSOR_FILES[0])
    image_processor = _read_json(directory / PROCESSOR_FILES[1])
    if processor is None and image_processor is None:
        raise ImagesUnavailable(f"the model's processor config ({' or '.join(PROCESSOR_FILES)}) is not in {directory}")
    processor = processor or {}
    nested = processor.get("image_processor")
    image_config = nested if isinstance(nested, dict) else image_processor or {}
    return rule(processor, image_config, encode)
