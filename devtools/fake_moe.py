"""The fake engine's MoE routing: ``routed_experts`` exactly as vLLM returns them (base64 ``.npy``,
one row per forward position, none for the last sampled token), computed from the token ids,
honouring ``routed_experts_prompt_start``; it can emulate a prefix cache whose hits come back as
``-1`` rows, and inject faults into the routing it returns.
"""

from __future__ import annotations

import base64
import io
from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class FakeMoE:
    """Routing of a pretend MoE: ``top_k`` of ``num_experts`` per layer, from the token ids."""

    num_layers: int = 4
    top_k: int = 2
    num_experts: int = 8
    dtype: str | None = None  # None: uint8/uint16 as vLLM; or force e.g. "int32"
    ignore_prompt_start: bool = False  # like an engine without routed_experts_prompt_start
    prefix_cache: bool = False  # cached prompt blocks come back as -1 rows (int32)
    block_size: int = 16
    faults: deque[str] = field(default_factory=deque)  # "short", "garbage", "float", "flip"
    seen: list[list[int]] = field(default_factory=list)

    def rows(self, tokens: list[int], features: np.ndarray | None = None) -> np.ndarray:
        """Row i: experts chosen when tokens[i] was an input (depends on it and its predecessor, and on
        ``features[i]`` where given: what an image position carries instead of its placeholder's embedding)."""
        ids = np.asarray(tokens, dtype=np.int64)
        previous = np.concatenate([[0], ids[:-1]])
        mixed = (ids * 1_000_003 + previous * 7919) % 2_147_483_647
        if features is not None:
            mixed = (mixed * 1_000_003 + features[: len(ids)] % 2_147_483_647) % 2_147_483_647
        layers = np.arange(self.num_layers, dtype=np.int64)
        base = (mixed[:, None] * 2_654_435_761 + layers[None, :] * 40_503) % self.num_experts
        picks = (base[:, :, None] + np.arange(self.top_k)[None, None, :]) % self.num_experts
        return picks

    def cached_prefix(self, prompt: list[int]) -> int:
        """Longest block-aligned prefix already computed (never the whole prompt)."""
        best = 0
        for sequence in self.seen:
            n = min(len(sequence), len(prompt) - 1)
            same = 0
            while same < n and sequence[same] == prompt[same]:
                same += 1
            best = max(best, same)
        return best - best % self.block_size

    def encode(
        self,
        prompt: list[int],
        sampled: list[int],
        start: int,
        *,
        record: bool = True,
        features: np.ndarray | None = None,
    ) -> tuple[str, int]:
        """(routed_experts field, cached prompt tokens) for one completion; ``record=False`` (a probe): it
        neither enters the pretend prefix cache nor takes an injected fault. ``features``: per prompt position,
        the image content there (``image_features``), 0 elsewhere."""
        sequence = prompt + sampled
        computed = self.rows(sequence[:-1], features).astype(np.int64)
        cached = self.cached_prefix(prompt) if self.prefix_cache else 0
        if record:
            self.seen.append(sequence)
        begin = 0 if self.ignore_prompt_start else start
        rows = computed[begin:]
        dtype = self.dtype or ("uint8" if self.num_experts <= 256 else "uint16")
        if cached > begin:
            rows[: cached - begin] = -1
            dtype = "int32"
        fault = self.faults.popleft() if self.faults and record else None
        if fault == "garbage":
            return "this is not base64 numpy!", cached
        if fault == "short":
            rows = rows[:-1]
        if fault == "flip" and len(rows):
            rows[0] = (rows[0] + 1) % self.num_experts
        array = rows.astype("float32" if fault == "float" else dtype)
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii"), cached


def image_features(length: int, ranges: list[dict[str, int]], digests: list[int]) -> np.ndarray:
    """Per position of a sequence of ``length``: inside an image's span (vLLM's ``mm_placeholders`` range) the
    image's digest plus the position's index in the span (each patch its own features), else 0. A real MoE
    routes an image position by the picture's features, not by its placeholder token: the fake's rows there
    depend on the picture."""
    features = np.zeros(length, dtype=np.int64)
    for span, digest in zip(ranges, digests, strict=True):
        features[span["offset"] : span["offset"] + span["length"]] = digest + np.arange(span["length"])
    return features
