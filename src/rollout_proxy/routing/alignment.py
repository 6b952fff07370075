"""One turn's rows, placed on the trajectory's positions.

A node keeps the rows its engine call returned from ``prompt_start(path)`` on: the
first position after the last row the path observed (normally the parent's last
token, which this turn's prefill computes); that is also the
``routed_experts_prompt_start`` sent to engines known to return routing. The count
is checked against the semantics: ``prompt_len - start + output_len - 1`` rows, or
``prompt_len + output_len - 1`` from an engine that was sent no start or ignored it.
Rows that overlap rows the path already holds are compared: a disagreement is
counted, never overwritten.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rollout_proxy.routing.engine_format import RoutingFormatError
from rollout_proxy.routing.rows import RoutingRows


def prompt_start(path: Sequence[Any]) -> int:
    """First position after the last row the path observed (0 when it observed none).

    Reads only the nodes' spans, newest first: constant work per turn in practice.
    """
    for node in reversed(path):
        span = node.routing_span
        if span is not None and span.last_observed >= 0:
            return span.last_observed + 1
    return 0


def first_row_position(*, prompt_len: int, output_len: int, requested_start: int, n_rows: int) -> int:
    """The position of the engine's first row, from how many rows it sent."""
    expected = prompt_len - requested_start + output_len - 1
    if n_rows == expected:
        return requested_start
    if n_rows == prompt_len + output_len - 1:
        return 0  # the engine was sent no start, or ignored it
    raise RoutingFormatError(
        f"engine returned {n_rows} routing rows; a turn of {prompt_len} prompt and {output_len} "
        f"output tokens from position {requested_start} has {expected}"
    )


def _held(path: Sequence[Any], begin: int, end: int, layout: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The path's rows for positions [begin, end) and which of them are observed."""
    experts = np.zeros((end - begin, *layout), dtype=np.int64)
    valid = np.zeros(end - begin, dtype=bool)
    for node in path:
        rows = node.routing
        if node.routing_span is None:
            continue
        if rows is None:
            raise ValueError("comparing rows needs the path loaded with its routing")
        lo, hi = max(begin, rows.start), min(end, rows.stop)
        if lo < hi:
            window = slice(lo - rows.start, hi - rows.start)
            experts[lo - begin : hi - begin] = rows.experts[window]
            valid[lo - begin : hi - begin] = rows.valid[window]
    return experts, valid


def align_turn(path: Sequence[Any], *, first: int, rows: np.ndarray, valid: np.ndarray) -> tuple[RoutingRows, int]:
    """(the new node's rows, how many overlapping rows disagreed with held ones).

    ``first`` is the position of ``rows[0]``; when it precedes ``prompt_start(path)``
    the path must be loaded with its routing, for the comparison.
    """
    layout = (rows.shape[1], rows.shape[2])
    held = next((node.routing_span for node in path if node.routing_span is not None), None)
    if held is not None and held.layout != layout:
        raise RoutingFormatError(f"routing layout changed from {held.layout} to {layout} within a trajectory")
    start = max(prompt_start(path), first)
    disagreements = 0
    if first < start:
        old, old_valid = _held(path, first, start, layout)
        both = old_valid & valid[: start - first]
        disagreements = int((old[both] != rows[: start - first][both]).any(axis=(1, 2)).sum())
    own = slice(start - first, None)
    return RoutingRows.compact(start, rows[own], valid[own]), disagreements
