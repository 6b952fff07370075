"""Responses API input items as chat messages, and back."""

from __future__ import annotations

import pytest
from openai.types.responses import Response

from rollout_proxy.wire.errors import WireFormatError
from rollout_proxy.wire.messages import normalize_messages
from rollout_proxy.wire.responses import assistant_message_of_response, input_to_messages, messages_as_input


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_string_is_one_user_message():
    assert input_to_messages("hi") == [{"role": "user", "content": "hi"}]
    assert input_to_messages(None) == []


def test_message_items_with_content_parts():
    items = [
        {"type": "message", "role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
    ]
    assert input_to_messages(items) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"}]


def test_reasoning_folds_into_the_assistant_message_that_follows():
    items = [
        {"role": "user", "content": "2+2?"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "add them"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
    ]
    assert input_to_messages(items)[1] == {"role": "assistant", "content": "4", "reasoning_content": "add them"}


def test_function_calls_group_into_one_assistant_message():
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "two cities"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "21C"}]},
    ]
    assert input_to_messages(items) == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                call("c1", "get_weather", '{"city": "Paris"}'),
                call("c2", "get_weather", '{"city": "Rome"}'),
            ],
            "reasoning_content": "two cities",
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": "21C"},
    ]


def test_a_function_call_after_assistant_text_joins_that_message():
    items = [
        {"role": "assistant", "content": "Let me check."},
        {"type": "function_call", "call_id": "c1", "name": "f"},
    ]
    assert input_to_messages(items) == [
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call("c1", "f", "{}")]}
    ]


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ({"role": "user", "content": "hi"}, "input"),
        (["hi"], "input[0]"),
        ([{"role": "user", "content": "hi"}, {"type": "image", "url": "x"}], "input[1].type"),
        ([{"type": "function_call", "name": "f"}], "input[0]"),
        ([{"type": "function_call", "call_id": "c1"}], "input[0]"),
        ([{"type": "function_call_output", "output": "x"}], "input[0]"),
        ([{"type": "function_call_output", "call_id": "c1", "output": 3}], "input[0].output"),
        ([{"role": "wizard", "content": "hi"}], "input[0].role"),
        ([{"role": "user", "content": [{"type": "input_image"}]}], "input[0].content[0].image_url"),
    ],
)
def test_bad_items_name_the_param(value, param):
    with pytest.raises(WireFormatError) as raised:
        input_to_messages(value)
    assert raised.value.param == param


def test_a_conversation_survives_a_round_trip_through_input_items():
    conversation = normalize_messages(
        [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": "Checking both.",
                "tool_calls": [
                    call("c1", "get_weather", '{"city": "Paris"}'),
                    call("c2", "get_weather", '{"city": "Rome"}'),
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "18C"},
            {"role": "tool", "tool_call_id": "c2", "content": "21C"},
            {"role": "assistant", "content": None, "tool_calls": [call("c3", "get_time", "{}")]},
            {"role": "tool", "tool_call_id": "c3", "content": "noon"},
            {"role": "assistant", "content": "Paris 18C, Rome 21C at noon."},
            {"role": "user", "content": "Thanks."},
        ]
    )
    assert input_to_messages(messages_as_input(conversation)) == conversation


def output_items() -> list[dict]:
    return [
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "look it up"}]},
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
            "status": "completed",
        },
    ]


def test_the_assistant_message_a_response_stands_for():
    expected = {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [call("c1", "get_weather", '{"city": "Paris"}')],
        "reasoning_content": "look it up",
    }
    assert assistant_message_of_response({"output": output_items()}) == expected
    sdk_response = Response.model_validate(
        {
            "id": "resp_1",
            "object": "response",
            "created_at": 0,
            "model": "m",
            "output": output_items(),
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        }
    )
    assert assistant_message_of_response(sdk_response) == expected


def test_a_response_with_only_calls_has_null_content_and_an_empty_one_empty_content():
    only_call = {"output": output_items()[2:]}
    assert assistant_message_of_response(only_call)["content"] is None
    assert assistant_message_of_response({"output": []}) == {"role": "assistant", "content": ""}
