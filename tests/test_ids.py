"""Response ids carry their session: a trajectory is found from the id alone, and a foreign id is recognised."""

from __future__ import annotations

import pytest

from rollout_proxy.ids import (
    new_request_id,
    new_response_id,
    new_session_id,
    new_tool_call_id,
    session_of_response,
)


def test_a_response_id_names_the_session_it_was_made_in():
    first, second = new_session_id(), new_session_id()
    assert first != second
    assert session_of_response(new_response_id(first)) == first
    assert session_of_response(new_response_id(second)) == second


def test_response_ids_of_one_session_differ():
    session = new_session_id()
    assert len({new_response_id(session) for _ in range(64)}) == 64


@pytest.mark.parametrize(
    "not_a_response",
    [
        "",
        "resp_",
        "sess_0123456789abcdef",  # a session id is not a response id
        "resp_0123456789abcdef",  # no node part
        "resp_0123456789ABCDEF0123456789abcdef",  # upper-case hex
        "resp_0123456789abcdef0123456789abcdef0",  # one character too many
        "chatcmpl-0123456789abcdef0123456789abcdef",
    ],
)
def test_an_id_that_is_not_a_response_id_has_no_session(not_a_response):
    assert session_of_response(not_a_response) is None


@pytest.mark.parametrize("not_a_session", ["", "sess_xyz", "resp_0123456789abcdef", "sess_0123456789abcdef "])
def test_a_response_id_is_only_made_for_a_session_id(not_a_session):
    with pytest.raises(ValueError, match="not a session id"):
        new_response_id(not_a_session)


def test_other_ids_have_their_prefixes_and_differ():
    calls = {new_tool_call_id() for _ in range(32)}
    requests = {new_request_id() for _ in range(32)}
    assert len(calls) == len(requests) == 32
    assert all(call.startswith("call_") for call in calls)
    assert all(request.startswith("req_") for request in requests)
