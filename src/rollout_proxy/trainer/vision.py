"""A multimodal sequence's vision inputs, rebuilt as the model takes them, and checked against its tokens.

The tokens stay the trajectory's (each image's placeholder span already expanded, as the engine ran it);
the pixels come from the image bytes on the group's entry, in span order, through the model's own image
processor (transformers', loaded from the model's directory: ``processor_config.json``), so the trainer sees
what the engine saw. Before the forward pass each span is checked against the ids: it is the model's span
token for token (the proxy's own rule, ``tokenization.images``, whose image token count must be what the model
merges per image), and no image token stands outside a span; a disagreement is refused in words (``BatchError``), not left to the model's shape error or, worse, to
embeddings merged at the wrong places. Today: Idefics3 without image splitting (``docs/images.md``).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollout_proxy.tokenization.images import ImagesUnavailable, load_placeholders
from rollout_proxy.trainer.batch import BatchError, PaddedBatch

#: the ``model_type`` of checkpoints whose vision inputs the trainer builds
VISION_MODEL_TYPES = frozenset({"idefics3"})


def model_type(model_dir: str | Path) -> str | None:
    """The ``model_type`` of a checkpoint's ``config.json`` (None without one: a LoRA adapter, say)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("model_type")
    return value if isinstance(value, str) else None


class VisionInputs:
    """The model's image processor and what its forward pass expects of the tokens."""

    def __init__(self, model_dir: str | Path, config: Any) -> None:
        from tokenizers import Tokenizer
        from transformers import AutoImageProcessor

        directory = Path(model_dir)
        self.processor = AutoImageProcessor.from_pretrained(str(directory))
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        try:  # the proxy's own rule: the span each image is expanded to, token for token
            self.placeholders = load_placeholders(
                directory, lambda text: tokenizer.encode(text, add_special_tokens=False).ids
            )
        except ImagesUnavailable as exc:
            raise ValueError(f"{directory}: {exc}") from None
        self.image_token_id = int(config.image_token_id)
        vision = config.vision_config
        #: the model merges this many image tokens per (unsplit) image: patches per side², by the pixel shuffle
        self.tokens_per_image = (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2
        in_span = int((self.placeholders.span_ids == self.image_token_id).sum())
        if self.placeholders.marker_id != self.image_token_id or in_span != self.tokens_per_image:
            raise ValueError(
                f"{directory}: its processor config expands an image to {in_span} of token "
                f"{self.placeholders.marker_id}, its model takes {self.tokens_per_image} of token "
                f"{self.image_token_id}: the files disagree"
            )

    def check(self, batch: PaddedBatch, width: int) -> None:
        """Each row's spans (those inside its first ``width`` tokens) are the model's span token for token, and
        no image token of those ``width`` stands outside a span."""
        expected = self.placeholders.span_ids
        for row, images in enumerate(batch.images):
            ids = batch.input_ids[row, : min(width, int(batch.lengths[row]))]
            inside = np.zeros(len(ids), dtype=bool)
            for index, image in enumerate(images):
                if image.start >= len(ids):
                    continue
                found = ids[image.start : image.start + image.length]
                if image.length != len(expected) or not np.array_equal(found, expected):
                    count = int((found == self.image_token_id).sum())
                    raise BatchError(
                        f"row {row}: image {index}'s span [{image.start}, {image.start + image.length}) holds "
                        f"{count} image token(s) (id {self.image_token_id}) in {image.length} tokens, not the "
                        f"model's span of {len(expected)} tokens with {self.tokens_per_image} image tokens "
                        "at its place: the span and the tokens disagree"
                    )
                inside[image.start : image.start + image.length] = True
            stray = np.flatnonzero((ids == self.image_token_id) & ~inside)
            if len(stray):
                raise BatchError(
                    f"row {row}: {len(stray)} image token(s) (id {self.image_token_id}) outside every image span, "
                    f"first at {int(stray[0])}: the model would take them for an image the sequence does not have"
                )

    def inputs(self, batch: PaddedBatch, width: int) -> dict[str, torch.Tensor]:
        """``pixel_values`` and ``pixel_attention_mask`` of the images within the first ``width`` tokens (checked)."""
        from PIL import Image

        self.check(batch, width)
        rows = [[image for image in images if image.start < width] for images in batch.images]
        if not any(rows):
            return {}
        if len(rows) != 1:
            raise BatchError(f"{len(rows)} rows with images in one micro-batch: one sequence with images per batch")
        pictures = [Image.open(io.BytesIO(image.data)) for image in rows[0]]
        out = self.processor(images=[pictures], return_tensors="pt")
        pixel_values, mask = out["pixel_values"], out["pixel_attention_mask"]
        if pixel_values.shape[1] != len(pictures):
            raise BatchError(
                f"the image processor made {pixel_values.shape[1]} images of {len(pictures)}: split images have "
                "no spans the trainer rebuilds"
            )
        return {"pixel_values": pixel_values.to(torch.float32), "pixel_attention_mask": mask}
