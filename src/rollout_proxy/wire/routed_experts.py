"""The trajectory's ``routed_experts`` field: a (T, layers, top_k) int16 array, -1 where unobserved.

On the wire it is ``{"dtype", "shape", "data"}`` with ``data`` the base64 of the array's
C-order bytes: compact, and decoded with one ``np.frombuffer``.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from rollout_proxy.wire.errors import WireFormatError


def encode_routed_experts(routing: np.ndarray | None) -> dict[str, Any] | None:
    if routing is None:
        return None
    return {
        "dtype": "int16",
        "shape": list(routing.shape),
        "data": base64.b64encode(np.ascontiguousarray(routing, dtype=np.int16).tobytes()).decode("ascii"),
    }


def decode_routed_experts(field: dict[str, Any] | None) -> np.ndarray | None:
    """The array back from its wire form (None stays None: a dense model)."""
    if field is None:
        return None
    try:
        dtype = np.dtype(field["dtype"])
        shape = [int(size) for size in field["shape"]]
        data = np.frombuffer(base64.b64decode(field["data"], validate=True), dtype=dtype)
        return data.reshape(shape)
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise WireFormatError(
            f"routed_experts is not a {{dtype, shape, data}} array: {exc}", param="routed_experts"
        ) from None
