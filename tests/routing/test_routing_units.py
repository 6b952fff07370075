"""The routing module on its own: engine format, compact storage, alignment."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from rollout_proxy.routing import (
    RoutingFormatError,
    RoutingRows,
    align_turn,
    decode_engine_routing,
    first_row_position,
    prompt_start,
)


def encode(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
def test_decodes_every_engine_dtype(dtype):
    array = (np.arange(5 * 3 * 2).reshape(5, 3, 2) % 7).astype(dtype)
    rows, valid = decode_engine_routing(encode(array))
    assert np.array_equal(rows, array) and valid.all()


def test_minus_one_rows_are_unobserved():
    array = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2)
    array[1] = -1
    _rows, valid = decode_engine_routing(encode(array))
    assert valid.tolist() == [True, False, True, True]


@pytest.mark.parametrize(
    "encoded",
    [
        "!!!",
        base64.b64encode(b"not numpy").decode(),
        encode(np.zeros((3, 2), dtype=np.uint8)),  # 2-d
        encode(np.zeros((3, 2, 2), dtype=np.float32)),  # not integers
        encode(np.array([[[1, -1]]], dtype=np.int32)),  # a partly negative row
        encode(np.array([[[-2, -2]]], dtype=np.int32)),
    ],
)
def test_malformed_arrays_are_refused(encoded):
    with pytest.raises(RoutingFormatError):
        decode_engine_routing(encoded)


@pytest.mark.parametrize("max_expert, dtype", [(7, np.uint8), (255, np.uint8), (256, np.uint16), (70000, np.uint32)])
def test_compact_uses_the_narrowest_unsigned_dtype(max_expert, dtype):
    experts = np.array([[[0, max_expert]], [[1, 2]]], dtype=np.int64)
    rows = RoutingRows.compact(10, experts, np.array([True, True]))
    assert rows.experts.dtype == dtype
    assert len(rows.to_bytes()) == rows.nbytes
    back = RoutingRows.from_bytes(rows.span, rows.to_bytes())
    assert back.start == 10
    assert np.array_equal(back.experts, rows.experts) and np.array_equal(back.valid, rows.valid)


class Node:
    def __init__(self, routing):
        self.routing = routing
        self.routing_span = None if routing is None else routing.span


def held(start, n, value=1):
    return Node(RoutingRows.compact(start, np.full((n, 2, 2), value), np.ones(n, dtype=bool)))


def test_prompt_start_is_after_the_last_observed_row():
    assert prompt_start([]) == 0
    assert prompt_start([held(0, 9)]) == 9
    tail_hole = RoutingRows.compact(9, np.ones((3, 2, 2)), np.array([True, False, False]))
    assert prompt_start([held(0, 9), Node(tail_hole)]) == 10
    assert prompt_start([held(0, 9), Node(None)]) == 9  # an injected node observed nothing


def test_single_turn_row_count_is_inputs_plus_decodes_minus_one():
    assert first_row_position(prompt_len=10, output_len=4, requested_start=0, n_rows=13) == 0
    with pytest.raises(RoutingFormatError, match="13"):
        first_row_position(prompt_len=10, output_len=4, requested_start=0, n_rows=12)
    aligned, disagreements = align_turn([], first=0, rows=np.ones((13, 2, 2), np.int64), valid=np.ones(13, bool))
    assert (aligned.start, aligned.stop, disagreements) == (0, 13, 0)


def test_later_turns_count_from_the_requested_start_or_from_zero():
    assert first_row_position(prompt_len=20, output_len=3, requested_start=13, n_rows=9) == 13
    assert first_row_position(prompt_len=20, output_len=3, requested_start=13, n_rows=22) == 0
    with pytest.raises(RoutingFormatError):
        first_row_position(prompt_len=20, output_len=3, requested_start=13, n_rows=10)


def test_rows_resent_by_an_engine_that_ignored_the_start_are_compared():
    path = [held(0, 13, value=1)]
    rows = np.ones((20 + 3 - 1, 2, 2), dtype=np.int64)
    rows[2] = 0  # the engine now disagrees about position 2
    aligned, disagreements = align_turn(path, first=0, rows=rows, valid=np.ones(22, bool))
    assert disagreements == 1
    assert (aligned.start, aligned.stop) == (13, 22)  # held rows are never overwritten
    assert path[0].routing.experts[2].tolist() == [[1, 1], [1, 1]]


def test_layout_cannot_change_within_a_trajectory():
    with pytest.raises(RoutingFormatError, match="layout"):
        align_turn([held(0, 13)], first=13, rows=np.ones((9, 4, 2), np.int64), valid=np.ones(9, bool))
