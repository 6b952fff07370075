"""A path's routing as one (T, layers, top_k) int16 array, in one pass over its nodes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def assemble_routing(path: Sequence[Any], total_tokens: int) -> np.ndarray | None:
    """Rows placed at their positions; ``-1`` wherever nothing was observed; None for dense models.

    The path must be loaded with its routing.
    """
    routed = [node for node in path if node.routing_span is not None]
    if not routed:
        return None
    layers, top_k = routed[0].routing_span.layout
    out = np.full((total_tokens, layers, top_k), -1, dtype=np.int16)
    for node in routed:
        rows = node.routing
        if rows is None:
            raise ValueError(f"node {node.id} was loaded without its routing")
        if rows.valid.all():
            out[rows.start : rows.stop] = rows.experts
        else:
            index = np.flatnonzero(rows.valid)
            out[rows.start + index] = rows.experts[index]
    return out
