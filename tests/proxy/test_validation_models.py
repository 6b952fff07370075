"""The edge's request models and bounds, without a server: exact shapes, exact ``param``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessage
from openai.types.responses import Response

from rollout_proxy.errors import InvalidRequest
from rollout_proxy.proxy.limits import (
    MAX_DEPTH,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_STRING_CHARS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    check_json_limits,
    format_param,
    parse_json_object,
)
from rollout_proxy.proxy.schemas import (
    RESERVED_TEMPLATE_KWARGS,
    AppendMessages,
    ChatRequest,
    FinishRequest,
    ResponsesRequest,
    SessionCreate,
)
from rollout_proxy.proxy.validation import validate

USER = {"role": "user", "content": "hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def refused(model: type, body: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as raised:
        validate(model, body)
    assert raised.value.status == 400
    return raised.value


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


# -- bounds on the whole body ------------------------------------------------------------------


def test_params_are_dotted_with_list_indexes():
    assert format_param(["messages", 2, "tool_calls", 0, "function", "arguments"]) == (
        "messages[2].tool_calls[0].function.arguments"
    )
    assert format_param([]) is None


def test_nesting_is_bounded_at_max_depth_and_named_where_it_is_crossed():
    check_json_limits({"a": nested(MAX_DEPTH - 1)})  # the body itself is one level
    with pytest.raises(InvalidRequest) as raised:
        check_json_limits({"extra": {"x": [nested(MAX_DEPTH)]}})
    # named: the first container one level too deep (the body, extra and x are the first three levels)
    assert raised.value.param == "extra.x" + "[0]" * (MAX_DEPTH + 1 - 3)


def test_strings_and_keys_are_bounded():
    check_json_limits({"s": "x" * MAX_STRING_CHARS})
    with pytest.raises(InvalidRequest) as raised:
        check_json_limits({"messages": [USER, {"role": "user", "content": "x" * (MAX_STRING_CHARS + 1)}]})
    assert raised.value.param == "messages[1].content"
    with pytest.raises(InvalidRequest) as raised:
        check_json_limits({"extra": {"k" * (MAX_STRING_CHARS + 1): 1}})
    assert raised.value.param == "extra"


def test_a_body_is_a_json_object_within_bounds():
    assert parse_json_object(b'{"a": [1, 2.5, null, true]}') == {"a": [1, 2.5, None, True]}
    for body in (b"[1]", b'"x"', b"{", b"[" * 2000 + b"]" * 2000):
        with pytest.raises(InvalidRequest):
            parse_json_object(body)
    with pytest.raises(InvalidRequest) as raised:
        parse_json_object(json.dumps({"context": nested(300)}).encode())
    assert raised.value.param.startswith("context[0][0]")


# -- messages ------------------------------------------------------------------------------------


def test_what_the_openai_sdk_sends_back_is_taken_as_sent():
    echoed = ChatCompletionMessage.model_validate(
        {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "look it up"}
    ).model_dump()
    assert {"refusal", "audio", "annotations", "function_call"} <= set(echoed)
    messages = [USER, echoed, {"role": "tool", "tool_call_id": "call_1", "content": "21C"}]
    body = validate(ChatRequest, {"messages": messages, "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert body.messages == messages  # the wire normalizers read the JSON as it came


def test_responses_output_items_are_taken_back_as_input():
    response = Response.model_validate(
        {
            "id": "resp_1",
            "object": "response",
            "created_at": 0,
            "model": "m",
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "output": [
                {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "look"}]},
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
                },
                {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}"},
            ],
        }
    )
    items = [
        *(item.model_dump() for item in response.output),
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ]
    assert validate(ResponsesRequest, {"input": items}).input == items


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": {"a": 1}, "content": "x"}, "messages[0].role"),
        ({"role": "user", "content": [{"type": ["text"], "text": "x"}]}, "messages[0].content[0]"),
        ({"role": "user", "content": [{"type": "input_audio"}]}, "messages[0].content[0]"),
        ({"role": "user", "content": [{"type": "text", "text": 1}]}, "messages[0].content[0].text"),
        ({"role": "user", "content": 3}, "messages[0].content"),
        ({"role": "user", "content": "x", "name": ["bob"]}, "messages[0].name"),
        ({"role": "user", "content": "x", "name": "b" * (MAX_NAME_CHARS + 1)}, "messages[0].name"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": [1]}}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"role": "assistant", "tool_calls": [{"type": "custom", "function": {"name": "f"}}]},
            "messages[0].tool_calls[0].type",
        ),
        ({"role": "assistant", "tool_calls": [{"id": 7, "function": {"name": "f"}}]}, "messages[0].tool_calls[0].id"),
        ({"role": "assistant", "tool_calls": [CALL] * (MAX_TOOL_CALLS + 1)}, "messages[0].tool_calls"),
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "tool", "content": "x", "tool_call_id": {"id": 1}}, "messages[0].tool_call_id"),
    ],
)
def test_bad_messages_name_their_field(message, param):
    for model, where in ((ChatRequest, {}), (AppendMessages, {})):
        assert refused(model, {"messages": [message], **where}).param == param
    assert refused(SessionCreate, {"sample": {"messages": [message]}}).param == f"sample.{param}"


def test_an_assistant_message_may_carry_neither_content_nor_tool_calls():
    """An answer that was all reasoning, echoed by a client that drops an empty content (as litellm drops a
    null one): an empty assistant turn, as vLLM takes it (the OpenAI API would refuse it)."""
    for message in ({"role": "assistant", "content": None}, {"role": "assistant", "tool_calls": None}):
        for model in (ChatRequest, AppendMessages):
            validate(model, {"messages": [USER, message]})
        validate(SessionCreate, {"sample": {"messages": [USER, message]}})


def test_message_counts_are_bounded():
    assert refused(ChatRequest, {"messages": []}).param == "messages"
    assert refused(ChatRequest, {"messages": [USER] * (MAX_MESSAGES + 1)}).param == "messages"
    validate(ChatRequest, {"messages": [USER] * MAX_MESSAGES})


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        ({"type": "teleport"}, "tools[0]"),
        ({"type": ["function"], "name": "f"}, "tools[0]"),
        ({"type": "namespace", "tools": []}, "tools[0].name"),
        ({"type": "namespace", "name": "ns", "tools": {}}, "tools[0].tools"),
        ({"type": "function", "function": {}}, "tools[0]"),
        ({"type": "function", "function": {"name": "f", "parameters": [1]}}, "tools[0].function.parameters"),
        ({"type": "function", "function": {"name": "f", "description": 3}}, "tools[0].function.description"),
        ({"type": "function", "name": "f", "parameters": "object"}, "tools[0].parameters"),
        ({"type": "function", "name": "f", "strict": "yes"}, "tools[0].strict"),
    ],
)
def test_bad_tools_name_their_field(tool, param):
    assert refused(ChatRequest, {"messages": [USER], "tools": [tool]}).param == param
    assert refused(ResponsesRequest, {"input": "hi", "tools": [tool]}).param == param


def test_hosted_custom_and_namespace_tools_are_accepted():
    """Left out of the prompt or rendered as their member functions (``wire.messages.split_tools``)."""
    tools = [
        {"type": "web_search", "external_web_access": False},
        {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
        {"type": "namespace", "name": "ns", "description": "d", "tools": [{"type": "function", "name": "f"}]},
    ]
    validate(ResponsesRequest, {"input": "hi", "tools": tools})
    validate(ChatRequest, {"messages": [USER], "tools": [{"type": "custom", "custom": {"name": "x"}}]})


def test_tool_counts_are_bounded():
    tool = {"type": "function", "name": "f"}
    assert refused(ChatRequest, {"messages": [USER], "tools": [tool] * (MAX_TOOLS + 1)}).param == "tools"


# -- Responses input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ({"role": "user", "content": "hi"}, "input"),
        (7, "input"),
        (["hi"], "input[0]"),
        ([{"type": "image", "url": "x"}], "input[0].type"),
        ([{"type": {"a": 1}}], "input[0].type"),
        ([{"content": "no role, no type"}], "input[0].type"),
        ([{"role": "assistant"}], "input[0].content"),
        ([{"type": "message", "role": "user", "content": None}], "input[0].content"),
        ([{"type": "function_call", "name": "f"}], "input[0].call_id"),
        ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": 3}], "input[0].arguments"),
        ([{"type": "function_call_output", "call_id": ["c"]}], "input[0].call_id"),
        ([{"type": "reasoning", "content": 5}], "input[0].content"),
        ([{"type": "reasoning", "summary": [{"type": "summary_text", "text": False}]}], "input[0].summary[0].text"),
    ],
)
def test_bad_input_items_name_their_field(value, param):
    assert refused(ResponsesRequest, {"input": value}).param == param


# -- the session-create, append and finish bodies --------------------------------------------------


@pytest.mark.parametrize("key", sorted(RESERVED_TEMPLATE_KWARGS))
def test_template_kwargs_the_proxy_sets_are_refused(key):
    body = {"sample": {"messages": [USER]}, "generation": {"chat_template_kwargs": {key: True}}}
    assert refused(SessionCreate, body).param == f"generation.chat_template_kwargs.{key}"


def test_a_template_kwarg_of_the_template_is_taken():
    body = {"sample": {"messages": [USER]}, "generation": {"chat_template_kwargs": {"enable_thinking": False}}}
    assert validate(SessionCreate, body).generation.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        (ChatRequest, {"messages": [USER], "stream": "true"}, "stream"),
        (ChatRequest, {"messages": [USER], "logprobs": 0}, "logprobs"),
        (ResponsesRequest, {"input": "hi", "store": "no"}, "store"),
        (ResponsesRequest, {"input": "hi", "previous_response_id": 5}, "previous_response_id"),
        (
            SessionCreate,
            {"sample": {"messages": [USER]}, "generation": {"max_new_tokens": "9"}},
            "generation.max_new_tokens",
        ),
        (SessionCreate, {"sample": {"messages": [USER]}, "n_sample": 2.0}, "n_sample"),
        (AppendMessages, {"messages": [USER], "previous_response_id": ["r"]}, "previous_response_id"),
        (FinishRequest, {"responses": [{"id": 1}]}, "responses[0].id"),
        (FinishRequest, {"error": {"e": 1}}, "error"),
    ],
)
def test_values_are_not_coerced(model, body, param):
    assert refused(model, body).param == param


def test_valid_bodies_still_pass():
    validate(SessionCreate, {"sample": {"messages": [USER], "extra": {"answer": 4}, "dataset_field": 1}, "context": {}})
    validate(SessionCreate, {"sample": {"messages": [USER]}, "generation": {"temperature": 1, "top_p": 0.9}})
    validate(FinishRequest, {"status": "success", "responses": [{"id": "resp_1", "extra": {"r": 1.0}}]})
