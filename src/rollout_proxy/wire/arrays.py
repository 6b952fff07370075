"""Compact numeric arrays on the wire: ``{"dtype", "shape", "data"}``, ``data`` the base64 of the C-order bytes.

The form ``routed_experts`` uses, for any dtype (the teacher's top-k: int32 ids, float32 logprobs).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from rollout_proxy.wire.errors import WireFormatError


def encode_array(array: np.ndarray) -> dict[str, Any]:
    contiguous = np.ascontiguousarray(array)
    return {
        "dtype": contiguous.dtype.name,
        "shape": list(contiguous.shape),
        "data": base64.b64encode(contiguous.tobytes()).decode("ascii"),
    }


def decode_array(field: dict[str, Any], *, param: str) -> np.ndarray:
    try:
        dtype = np.dtype(field["dtype"])
        shape = [int(size) for size in field["shape"]]
        return np.frombuffer(base64.b64decode(field["data"], validate=True), dtype=dtype).reshape(shape)
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise WireFormatError(f"{param} is not a {{dtype, shape, data}} array: {exc}", param=param) from None
