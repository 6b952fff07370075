"""The routed-experts codec: (T, layers, top_k) int16 arrays with -1 rows, as compact JSON."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from rollout_proxy.wire.errors import WireFormatError
from rollout_proxy.wire.routed_experts import decode_routed_experts, encode_routed_experts


def routing(rows: int = 5, layers: int = 3, top_k: int = 2) -> np.ndarray:
    array = np.arange(rows * layers * top_k, dtype=np.int16).reshape(rows, layers, top_k) % 64
    array[[1, rows - 1]] = -1  # positions without a forward pass
    return array


def test_round_trip_keeps_values_shape_and_unobserved_rows():
    array = routing()
    field = orjson.loads(orjson.dumps(encode_routed_experts(array)))  # as it travels
    assert field["dtype"] == "int16" and field["shape"] == [5, 3, 2]
    decoded = decode_routed_experts(field)
    assert decoded.dtype == np.int16 and np.array_equal(decoded, array)
    assert (decoded[1] == -1).all() and (decoded[-1] == -1).all()


def test_wider_and_strided_inputs_are_stored_as_int16():
    wide = routing().astype(np.int64)[:, :, ::-1]
    assert np.array_equal(decode_routed_experts(encode_routed_experts(wide)), wide)


def test_an_empty_trajectory_round_trips():
    empty = np.zeros((0, 3, 2), dtype=np.int16)
    assert decode_routed_experts(encode_routed_experts(empty)).shape == (0, 3, 2)


def test_none_stays_none():
    assert encode_routed_experts(None) is None
    assert decode_routed_experts(None) is None


@pytest.mark.parametrize(
    "field",
    [
        {"shape": [1, 1, 1], "data": ""},
        {"dtype": "int16", "shape": [3, 3, 2], "data": encode_routed_experts(routing(rows=2))["data"]},
        {"dtype": "int16", "shape": [1, 3, 2], "data": "not base64!"},
        {"dtype": "no-such-dtype", "shape": [1], "data": "AAA="},
        {"dtype": "int16", "shape": "wide", "data": ""},
        "AAAA",
        [1, 2, 3],
    ],
    ids=["no-dtype", "wrong-shape", "bad-base64", "bad-dtype", "bad-shape", "a-string", "a-list"],
)
def test_malformed_fields_are_wire_format_errors(field):
    with pytest.raises(WireFormatError) as raised:
        decode_routed_experts(field)
    assert raised.value.param == "routed_experts"
