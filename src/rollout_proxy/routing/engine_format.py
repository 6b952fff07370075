"""vLLM's wire format for routed experts: base64 of a ``.npy`` array.

Shape ``(rows, num_layers, top_k)``; uint8 when there are at most 256 experts, else
uint16. Signed (e.g. int32) arrays are accepted too, where a row of ``-1`` means the
engine did not compute that position (a prefix-cache hit): it stays unobserved.
"""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np


class RoutingFormatError(ValueError):
    """The engine's routing array is malformed or does not fit the turn."""


def decode_engine_routing(encoded: str) -> tuple[np.ndarray, np.ndarray]:
    """(rows (rows, layers, top_k) in the engine's integer dtype, validity per row)."""
    try:
        raw = base64.b64decode(encoded, validate=True)
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as exc:
        raise RoutingFormatError(f"routed_experts is not a base64 .npy array: {exc}") from None
    if not isinstance(array, np.ndarray) or array.ndim != 3 or array.dtype.kind not in "ui":
        kind = f"{getattr(array, 'dtype', type(array).__name__)} {getattr(array, 'shape', '')}"
        raise RoutingFormatError(f"routed_experts must be a 3-d integer array, got {kind}")
    if array.dtype.kind == "u":
        return array, np.ones(len(array), dtype=bool)
    negative = array < 0
    missing = np.asarray(negative.all(axis=(1, 2)))  # asarray: the stubs say .all(axis) may be a scalar
    if (negative.any(axis=(1, 2)) & ~missing).any() or (array[missing] != -1).any():
        raise RoutingFormatError("routed_experts has negative expert ids outside whole -1 rows")
    return array, ~missing
