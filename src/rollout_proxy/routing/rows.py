"""Compact per-node routing: the narrowest unsigned dtype plus a validity mask.

A node's routing is kept in two parts: a small ``RoutingSpan`` in the node header
(where its rows are, which was the last observed one) that every turn reads, and
the ``RoutingRows`` themselves, stored apart and read only to build a trajectory or
to compare rows an engine sent twice. A turn's cost therefore does not grow with the
routing its ancestors hold.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


def narrowest_unsigned(max_value: int) -> np.dtype:
    for dtype in (np.uint8, np.uint16, np.uint32):
        if max_value <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"expert id {max_value} does not fit in 32 bits")


@dataclass(frozen=True, slots=True)
class RoutingSpan:
    """Where a node's rows are: positions ``start .. stop``, and the last observed one."""

    start: int
    stop: int
    layers: int
    top_k: int
    dtype: str
    last_observed: int  # absolute position, -1 if the node observed no row

    @property
    def layout(self) -> tuple[int, int]:
        return self.layers, self.top_k

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoutingSpan:
        return cls(**data)


@dataclass(frozen=True, slots=True)
class RoutingRows:
    """Rows for positions ``start .. start + len(valid)``; invalid rows hold zeros."""

    start: int
    experts: np.ndarray  # (rows, layers, top_k), unsigned
    valid: np.ndarray  # (rows,), bool

    @property
    def stop(self) -> int:
        return self.start + len(self.valid)

    @property
    def layout(self) -> tuple[int, int]:
        return self.experts.shape[1], self.experts.shape[2]

    @property
    def span(self) -> RoutingSpan:
        observed = np.flatnonzero(self.valid)
        return RoutingSpan(
            start=self.start,
            stop=self.stop,
            layers=self.layout[0],
            top_k=self.layout[1],
            dtype=self.experts.dtype.str,
            last_observed=self.start + int(observed[-1]) if len(observed) else -1,
        )

    @classmethod
    def compact(cls, start: int, experts: np.ndarray, valid: np.ndarray) -> RoutingRows:
        """From engine rows (any integer dtype; invalid rows may hold -1)."""
        valid = valid.astype(bool, copy=False)
        kept = experts if valid.all() else np.where(valid[:, None, None], experts, 0)
        dtype = narrowest_unsigned(int(kept.max()) if kept.size else 0)
        return cls(start=start, experts=kept.astype(dtype, copy=False), valid=valid)

    # -- packed bytes: rows, then one bit per row ---------------------------------------

    def to_bytes(self) -> bytes:
        return self.experts.tobytes() + np.packbits(self.valid).tobytes()

    @classmethod
    def from_bytes(cls, span: RoutingSpan, blob: bytes) -> RoutingRows:
        rows = span.stop - span.start
        dtype = np.dtype(span.dtype)
        count = rows * span.layers * span.top_k
        experts = np.frombuffer(blob, dtype=dtype, count=count).reshape(rows, span.layers, span.top_k)
        mask = np.frombuffer(blob, dtype=np.uint8, count=(rows + 7) // 8, offset=count * dtype.itemsize)
        return cls(start=span.start, experts=experts, valid=np.unpackbits(mask, count=rows).astype(bool))

    @property
    def nbytes(self) -> int:
        return self.experts.nbytes + (len(self.valid) + 7) // 8
