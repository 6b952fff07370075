"""Message and tool normalization: one stored form, and errors that name the field."""

from __future__ import annotations

import pytest
from openai.types.chat import ChatCompletionMessage

from rollout_proxy.wire.errors import WireFormatError
from rollout_proxy.wire.messages import content_text, normalize_message, normalize_messages, normalize_tools


def test_the_sdks_model_dump_loses_its_null_fields():
    dumped = ChatCompletionMessage.model_validate({"role": "assistant", "content": "Hi."}).model_dump()
    assert normalize_message(dumped) == {"role": "assistant", "content": "Hi."}


def test_text_parts_are_joined_with_newlines():
    parts = [{"type": "text", "text": "one"}, "two", {"type": "input_text", "text": "three"}]
    assert normalize_message({"role": "user", "content": parts}) == {"role": "user", "content": "one\ntwo\nthree"}
    assert content_text({"type": "output_text", "text": "single"}) == "single"


def test_tool_calls_get_json_arguments_ids_and_a_type():
    message = normalize_message(
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]}
    )
    assert message["tool_calls"] == [
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}
    ]
    assert message["content"] is None


def test_reasoning_is_kept_under_one_name():
    assert normalize_message({"role": "assistant", "content": "4", "reasoning": "2+2"})["reasoning_content"] == "2+2"
    assert "reasoning_content" not in normalize_message({"role": "assistant", "content": "4", "reasoning_content": ""})
    assert "reasoning_content" not in normalize_message({"role": "user", "content": "4", "reasoning_content": "x"})


def test_tool_messages_keep_their_call_id():
    assert normalize_message({"role": "tool", "tool_call_id": "c1", "content": "ok", "name": "f"}) == {
        "role": "tool",
        "content": "ok",
        "name": "f",
        "tool_call_id": "c1",
    }


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ("just text", "messages[3]"),
        ({"role": "robot", "content": "hi"}, "messages[3].role"),
        ({"role": "user", "content": None}, "messages[3].content"),
        ({"role": "user", "content": 42}, "messages[3].content"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}, "messages[3].content[0].image_url"),
        ({"role": "user", "content": [{"type": "audio", "audio": "x"}]}, "messages[3].content[0]"),
        ({"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages[3].content[0]"),
        ({"role": "user", "content": [{"type": "text", "text": None}]}, "messages[3].content[0].text"),
        ({"role": "tool", "content": "ok"}, "messages[3].tool_call_id"),
        ({"role": "assistant", "tool_calls": {"function": {}}}, "messages[3].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"type": "function"}]}, "messages[3].tool_calls[0]"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
            "messages[3].tool_calls[0].function.name",
        ),
    ],
)
def test_bad_shapes_name_the_field(message, param):
    with pytest.raises(WireFormatError) as raised:
        normalize_message(message, param="messages[3]")
    assert raised.value.param == param
    assert isinstance(raised.value, ValueError)  # plugin code may catch it as a plain ValueError


def test_a_list_of_messages_names_the_index():
    assert normalize_messages([{"role": "user", "content": "a"}]) == [{"role": "user", "content": "a"}]
    with pytest.raises(WireFormatError) as raised:
        normalize_messages([{"role": "user", "content": "a"}, {"role": "user"}])
    assert raised.value.param == "messages[1].content"
    with pytest.raises(WireFormatError) as raised:
        normalize_messages({"role": "user", "content": "a"})
    assert raised.value.param == "messages"


def test_tools_in_responses_form_become_chat_form():
    flat = [{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}]
    nested = [
        {
            "type": "function",
            "function": {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    assert normalize_tools(flat) == normalize_tools(nested) == nested


def test_a_tool_without_parameters_takes_an_empty_object():
    assert normalize_tools([{"type": "function", "function": {"name": "now"}}]) == [
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    ]
    assert normalize_tools(None) is None


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ({"name": "f"}, "tools"),
        ([{"type": "web_search"}], "tools[0]"),
        ([{"type": "function", "function": {"description": "no name"}}], "tools[0]"),
    ],
)
def test_bad_tools_name_the_field(tools, param):
    with pytest.raises(WireFormatError) as raised:
        normalize_tools(tools)
    assert raised.value.param == param
