"""Messages echoed back the way clients do must match the node that produced them."""

from __future__ import annotations

import pytest
from openai.types.chat import ChatCompletionMessage

from rollout_proxy.tokenization.messages import canonical_key, path_hashes
from rollout_proxy.wire.errors import WireFormatError
from rollout_proxy.wire.messages import normalize_message, normalize_tools

PRODUCED = {
    "role": "assistant",
    "content": "Let me check.",
    "reasoning_content": "The user wants weather.",
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
        }
    ],
}


def key(message):
    return canonical_key(normalize_message(message))


def test_sdk_model_dump_with_null_fields_matches():
    dumped = ChatCompletionMessage.model_validate(PRODUCED).model_dump()
    assert dumped["refusal"] is None and dumped["audio"] is None  # the SDK's null fields
    assert key(dumped) == key(PRODUCED)


@pytest.mark.parametrize(
    "variant",
    [
        {**PRODUCED, "reasoning_content": None},  # the client dropped the reasoning
        {k: v for k, v in PRODUCED.items() if k != "reasoning_content"},
        {**PRODUCED, "content": [{"type": "text", "text": "Let me check."}]},  # text parts
        {
            **PRODUCED,
            "tool_calls": [
                {
                    "id": "other-id",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"unit":"C","city":"Paris"}'},
                }
            ],
        },
    ],
)
def test_echo_variants_match(variant):
    assert key(variant) == key(PRODUCED)


@pytest.mark.parametrize(
    "variant",
    [
        {**PRODUCED, "content": "Let me check!"},
        {
            **PRODUCED,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {**PRODUCED, "tool_calls": None},
        {**PRODUCED, "role": "user"},
    ],
)
def test_real_differences_do_not_match(variant):
    assert key(variant) != key(PRODUCED)


def test_tool_call_id_matters_for_tool_messages():
    assert key({"role": "tool", "tool_call_id": "a", "content": "x"}) != key(
        {"role": "tool", "tool_call_id": "b", "content": "x"}
    )


def test_empty_and_null_assistant_content_match():
    assert key({"role": "assistant", "content": None}) == key({"role": "assistant", "content": ""})


def test_path_hashes_are_rolling():
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    full = path_hashes(messages)
    assert len(full) == 2 and full[0] == path_hashes(messages[:1])[0]
    assert path_hashes(messages[1:], start=full[0]) == full[1:]
    assert path_hashes(list(reversed(messages)))[-1] != full[-1]


def test_bad_shapes_name_the_field():
    with pytest.raises(WireFormatError) as raised:
        normalize_message({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, param="messages[3]")
    assert raised.value.param == "messages[3].tool_calls[0].function.name"


def test_tools_in_responses_form_become_chat_form():
    flat = [{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}]
    nested = [
        {
            "type": "function",
            "function": {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    assert normalize_tools(flat) == normalize_tools(nested) == nested
