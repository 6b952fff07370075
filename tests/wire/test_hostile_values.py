"""The normalizers on hostile values: they raise ``WireFormatError`` and nothing else.

Plugin code calls them too, with whatever it holds, so any JSON value in any position of
a message, a tool or a Responses item either normalizes or is refused naming its place;
what does normalize can be encoded and hashed (the proxy stores and matches it).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_proxy.tokenization.messages import canonical_key
from rollout_proxy.wire.errors import WireFormatError
from rollout_proxy.wire.messages import (
    MAX_JSON_DEPTH,
    content_text,
    normalize_message,
    normalize_messages,
    normalize_tools,
    too_deep,
)
from rollout_proxy.wire.responses import input_to_messages


def nested(depth: int, leaf: Any = 1) -> Any:
    """A list nested ``depth`` levels deep."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


# -- the defects a probe found, one by one -----------------------------------------------------


@pytest.mark.parametrize("role", [{"a": 1}, ["user"], 3, None, True])
def test_a_role_of_any_type_is_refused_by_name(role):
    with pytest.raises(WireFormatError) as raised:
        normalize_message({"role": role, "content": "hi"})
    assert raised.value.param == "messages.role"


@pytest.mark.parametrize("kind", [{"a": 1}, ["text"], 3, None])
def test_a_part_type_of_any_type_is_refused_naming_the_part(kind):
    with pytest.raises(WireFormatError) as raised:
        content_text([{"type": kind, "text": "x"}], param="messages[0]")
    assert raised.value.param == "messages[0].content[0]"


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "reasoning", "content": 5}, "input[0].content"),
        ({"type": "reasoning", "content": True}, "input[0].content"),
        ({"type": "reasoning", "content": "text"}, "input[0].content"),
        ({"type": "reasoning", "summary": 1.5}, "input[0].summary"),
        ({"type": "reasoning", "summary": {"text": "x"}}, "input[0].summary"),
        ({"type": "reasoning", "summary": [{"text": 3}]}, "input[0].summary[0]"),
        ({"type": "reasoning", "content": [{"text": ["a"]}]}, "input[0].content[0]"),
        ({"type": "reasoning", "content": ["a"]}, "input[0].content[0]"),
        ({"type": {"a": 1}}, "input[0].type"),
    ],
)
def test_reasoning_items_that_are_not_text_are_refused(item, param):
    with pytest.raises(WireFormatError) as raised:
        input_to_messages([item])
    assert raised.value.param == param


def test_reasoning_of_either_kind_still_folds_in():
    items = [
        {"type": "reasoning", "content": None, "summary": [{"type": "summary_text", "text": "a"}]},
        {"role": "assistant", "content": "4"},
    ]
    assert input_to_messages(items)[0]["reasoning_content"] == "a"
    assert input_to_messages([{"type": "reasoning", "summary": []}, {"role": "assistant", "content": "4"}]) == [
        {"role": "assistant", "content": "4"}
    ]


def call_with(arguments: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": arguments}}]}


@pytest.mark.parametrize(
    "arguments",
    [
        nested(MAX_JSON_DEPTH + 1),
        nested(300),
        json.dumps(nested(300)),  # as a JSON string: parsed to be bounded, as the proxy parses it to hash it
        10**30,  # past 64 bits: the encoder refuses it
        {"n": 10**30},
    ],
    ids=["just-past", "deep", "deep-string", "big-int", "big-int-inside"],
)
def test_arguments_the_proxy_could_not_encode_or_hash_are_refused(arguments):
    with pytest.raises(WireFormatError) as raised:
        normalize_message(call_with(arguments), param="messages[1]")
    assert raised.value.param == "messages[1].tool_calls[0].function.arguments"


def test_arguments_within_bounds_pass_unchanged():
    text = json.dumps(nested(MAX_JSON_DEPTH - 1))
    assert normalize_message(call_with(text))["tool_calls"][0]["function"]["arguments"] == text
    assert (
        normalize_message(call_with({"x": nested(10)}))["tool_calls"][0]["function"]["arguments"]
        == orjson.dumps({"x": nested(10)}).decode()
    )
    assert normalize_message(call_with("not json {[")) is not None


def test_a_function_call_item_joining_a_message_is_normalized_too():
    items = [
        {"role": "assistant", "content": "Checking."},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": {"city": "Paris"}},
    ]
    assert input_to_messages(items)[0]["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris"}'
    with pytest.raises(WireFormatError) as raised:
        input_to_messages([items[0], {**items[1], "arguments": nested(300)}])
    assert raised.value.param == "input[1].arguments"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": "a", "name": {"a": 1}}, "messages.name"),
        ({"role": "user", "content": "a", "name": nested(300)}, "messages.name"),
        ({"role": "user", "content": "a", "name": 5}, "messages.name"),
        (
            {"role": "assistant", "tool_calls": [{"id": {"a": 1}, "function": {"name": "f"}}]},
            "messages.tool_calls[0].id",
        ),
    ],
)
def test_names_and_ids_must_be_strings(message, param):
    with pytest.raises(WireFormatError) as raised:
        normalize_message(message)
    assert raised.value.param == param


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        ({"type": "function", "function": {"name": "f", "parameters": nested(300)}}, "tools[0].function.parameters"),
        ({"type": "function", "function": {"name": "f", "parameters": [1]}}, "tools[0].function.parameters"),
        ({"type": "function", "name": "f", "parameters": "object"}, "tools[0].parameters"),
        ({"type": "function", "name": "f", "parameters": {"max": 10**30}}, "tools[0].parameters"),
        ({"type": "function", "function": {"name": "f", "description": {"a": 1}}}, "tools[0].function.description"),
        ({"type": {"a": 1}, "name": "f"}, "tools[0]"),
        ({"type": "function", "function": None}, "tools[0]"),
    ],
)
def test_tools_with_bad_free_form_parts_are_refused(tool, param):
    with pytest.raises(WireFormatError) as raised:
        normalize_tools([tool])
    assert raised.value.param == param


def test_too_deep_counts_containers_without_recursion():
    assert not too_deep(nested(MAX_JSON_DEPTH, leaf="x"))
    assert too_deep(nested(MAX_JSON_DEPTH + 1, leaf="x"))
    assert too_deep(nested(5000), limit=10)  # no RecursionError however deep
    assert not too_deep("[[[[") and not too_deep(None)


def test_an_error_message_never_echoes_a_whole_value():
    with pytest.raises(WireFormatError) as raised:
        normalize_message({"role": nested(900), "content": "x"})
    assert len(raised.value.message) < 100


# -- property: any JSON value anywhere ---------------------------------------------------------

# Integers past 64 bits are JSON too (Python's json reads them); orjson cannot encode them.
SCALARS = st.none() | st.booleans() | st.integers() | st.integers(min_value=2**64) | st.floats() | st.text(max_size=12)
JSON = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=12,
)


def either(*known: Any) -> st.SearchStrategy[Any]:
    """A value the code looks for, or anything at all."""
    return st.sampled_from(known) | JSON


PART = st.fixed_dictionaries(
    {}, optional={"type": either("text", "input_text", "output_text", "image_url"), "text": either("hi", "")}
)
CONTENT = either("hi", "", None) | st.lists(PART | either("hi"), max_size=3) | PART
FUNCTION = st.fixed_dictionaries(
    {}, optional={"name": either("f", ""), "arguments": either("{}", '{"a": 1}', "[", None)}
)
CALL = st.fixed_dictionaries(
    {}, optional={"id": either("c1", None), "type": either("function"), "function": FUNCTION | JSON}
)
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": either("system", "developer", "user", "assistant", "tool"),
        "content": CONTENT,
        "name": either("bob", "", None),
        "tool_calls": st.lists(CALL | JSON, max_size=2) | JSON,
        "tool_call_id": either("c1", ""),
        "reasoning_content": either("why"),
        "reasoning": either("why"),
        "refusal": JSON,
    },
)
SPEC = {"name": either("f"), "description": either("d", None), "parameters": either({}, None) | JSON}
TOOL = st.fixed_dictionaries(
    {}, optional={"type": either("function"), "function": st.fixed_dictionaries({}, optional=SPEC) | JSON}
) | st.fixed_dictionaries({}, optional={"type": either("function"), **SPEC})
ITEM = (
    MESSAGE.map(lambda message: {"type": "message", **message})
    | st.fixed_dictionaries(
        {"type": st.just("function_call")},
        optional={"call_id": either("c1"), "name": either("f"), "arguments": either("{}", None)},
    )
    | st.fixed_dictionaries(
        {"type": st.just("function_call_output")}, optional={"call_id": either("c1"), "output": CONTENT}
    )
    | st.fixed_dictionaries(
        {"type": st.just("reasoning")},
        optional={
            "content": st.lists(PART | JSON, max_size=2) | JSON,
            "summary": st.lists(PART | JSON, max_size=2) | JSON,
        },
    )
    | st.fixed_dictionaries({}, optional={"type": JSON, "role": JSON, "content": JSON})
)
PROPERTY = settings(
    max_examples=400, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def assert_storable(messages: list[dict[str, Any]]) -> None:
    """What normalized can be encoded, and hashed as the proxy matches messages."""
    orjson.dumps(messages)
    for message in messages:
        canonical_key(message)


@PROPERTY
@given(st.lists(MESSAGE | JSON, max_size=4) | JSON)
def test_any_messages_normalize_or_raise_a_wire_format_error(messages):
    try:
        normalized = normalize_messages(messages)
    except WireFormatError as exc:
        assert exc.param and exc.param.startswith("messages")
        return
    assert_storable(normalized)


@PROPERTY
@given(st.lists(TOOL | JSON, max_size=3) | JSON)
def test_any_tools_normalize_or_raise_a_wire_format_error(tools):
    try:
        normalized = normalize_tools(tools)
    except WireFormatError as exc:
        assert exc.param and exc.param.startswith("tools")
        return
    orjson.dumps(normalized)


@PROPERTY
@given(st.lists(ITEM | JSON, max_size=4) | JSON)
def test_any_responses_input_normalizes_or_raises_a_wire_format_error(value):
    try:
        messages = input_to_messages(value)
    except WireFormatError as exc:
        assert exc.param and exc.param.startswith("input")
        return
    assert_storable(messages)
    with contextlib.suppress(WireFormatError):  # what the SDK then does with it
        normalize_messages(messages)
