"""``{dtype, shape, data}`` arrays (the teacher's top-k on a trajectory): exact round trips, and a bad field named."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from rollout_proxy.wire.arrays import decode_array, encode_array
from rollout_proxy.wire.errors import WireFormatError


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.int32).reshape(3, 4),
        np.linspace(-5.0, 0.0, 6, dtype=np.float32).reshape(2, 3),
        np.zeros((0, 4), dtype=np.int32),
        np.array([2**40, -1], dtype=np.int64),
    ],
)
def test_arrays_round_trip_with_dtype_and_shape(array):
    field = encode_array(array)
    assert field["dtype"] == array.dtype.name and field["shape"] == list(array.shape)
    back = decode_array(field, param="teacher_topk.ids")
    assert back.dtype == array.dtype and back.shape == array.shape
    assert np.array_equal(back, array)


def test_a_non_contiguous_view_is_sent_in_c_order():
    array = np.arange(12, dtype=np.int32).reshape(3, 4).T  # Fortran-ordered view
    assert np.array_equal(decode_array(encode_array(array), param="x"), array)


def test_the_field_is_json_ready():
    field = encode_array(np.ones((2, 2), dtype=np.float32))
    assert isinstance(field["data"], str) and all(isinstance(size, int) for size in field["shape"])


@pytest.mark.parametrize(
    "field",
    [
        {"shape": [2], "data": ""},  # no dtype
        {"dtype": "int32", "data": ""},  # no shape
        {"dtype": "no-such-type", "shape": [1], "data": ""},
        {"dtype": "int32", "shape": [2], "data": "!!!"},  # not base64
        {"dtype": "int32", "shape": [3], "data": base64.b64encode(b"\0" * 8).decode()},  # 2 values, shape says 3
        {"dtype": "int32", "shape": ["two"], "data": ""},
        "not an object",
    ],
)
def test_a_malformed_array_is_a_wire_error_naming_the_field(field):
    with pytest.raises(WireFormatError, match=r"teacher_topk\.logprobs") as caught:
        decode_array(field, param="teacher_topk.logprobs")
    assert caught.value.param == "teacher_topk.logprobs"
