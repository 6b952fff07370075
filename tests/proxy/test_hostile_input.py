"""Hostile request bodies are a 400 naming the field, never a 500 or a 502, and change nothing.

One test per defect a probe found (both stores, both chat templates): values of the wrong
JSON type where the code hashed or iterated them, JSON nested past what an encoder takes,
messages a template cannot render, settings that override the proxy's own rendering, and
injected messages past the context.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollout_proxy.proxy import keys
from rollout_proxy.proxy.limits import MAX_STRING_CHARS
from tests.harness import ADMIN_KEY, WEATHER_TOOL, ProxyHarness, store_snapshot

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
DEEP = 300  # past orjson's ~254 levels, within its parser's 1024


def nested(depth: int) -> dict[str, Any]:
    """An object nested ``depth`` levels deep."""
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def assert_refused(status: int, body: Any, param: str, *, code: str | None = None) -> None:
    assert status == 400, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


async def send(proxy: ProxyHarness, path: str, body: dict[str, Any], token: str | None = ADMIN_KEY) -> tuple[int, Any]:
    """``body`` encoded by the standard library (orjson, the harness's encoder, refuses deep JSON)."""
    headers = {"Content-Type": "application/json"}
    return await proxy.request("POST", path, data=json.dumps(body).encode(), token=token, headers=headers)


@pytest.fixture
async def session(proxy: ProxyHarness):
    """A session with one turn, so that every route has a tree to leave unchanged."""
    made = await proxy.create_session(USER)
    await made.client.chat.completions.create(model="m", messages=USER)
    return made


async def snapshot(proxy: ProxyHarness) -> Any:
    return await store_snapshot(proxy.app[keys.STORE])


# -- roles and content part types that are objects or lists (were "unhashable type": 500) -----------


@pytest.mark.parametrize("role", [{"name": "user"}, ["user"]])
async def test_a_role_that_is_an_object_or_a_list_is_400_on_every_route(proxy, session, role):
    before = await snapshot(proxy)
    message = {"role": role, "content": "hi"}
    status, body = await send(proxy, "/v1/chat/completions", {"messages": [message]}, session.api_key)
    assert_refused(status, body, "messages[0].role")
    status, body = await send(proxy, f"/v1/sessions/{session.session_id}/messages", {"messages": [message]})
    assert_refused(status, body, "messages[0].role")
    status, body = await send(proxy, "/v1/responses", {"input": [message]}, session.api_key)
    assert_refused(status, body, "input[0].role")
    status, body = await send(proxy, "/v1/sessions", {"sample": {"messages": [*USER, message]}})
    assert_refused(status, body, "sample.messages[1].role")
    assert await snapshot(proxy) == before


@pytest.mark.parametrize("kind", [{"t": "text"}, ["text"]])
async def test_a_content_part_type_that_is_an_object_or_a_list_is_400(proxy, session, kind):
    before = await snapshot(proxy)
    message = {"role": "user", "content": [{"type": kind, "text": "hi"}]}
    status, body = await send(proxy, "/v1/chat/completions", {"messages": [message]}, session.api_key)
    assert_refused(status, body, "messages[0].content[0]")
    assert "only text and image content parts" in body["error"]["message"]
    status, body = await send(proxy, "/v1/responses", {"input": [message]}, session.api_key)
    assert_refused(status, body, "input[0].content[0]")
    assert await snapshot(proxy) == before


# -- Responses reasoning items whose parts are not lists of text (were a TypeError: 500) ----------


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "reasoning", "content": 5}, "input[1].content"),
        ({"type": "reasoning", "content": True}, "input[1].content"),
        ({"type": "reasoning", "summary": 2.5}, "input[1].summary"),
        ({"type": "reasoning", "summary": [{"type": "summary_text", "text": 7}]}, "input[1].summary[0].text"),
        ({"type": "reasoning", "content": [{"type": "reasoning_text", "text": ["a"]}]}, "input[1].content[0].text"),
    ],
)
async def test_a_reasoning_item_with_non_text_parts_is_400(proxy, session, item, param):
    before = await snapshot(proxy)
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}
    body = {"input": [USER[0], item, answer, {"role": "user", "content": "And tomorrow?"}]}
    status, answer_body = await send(proxy, "/v1/responses", body, session.api_key)
    assert_refused(status, answer_body, param)
    assert await snapshot(proxy) == before


# -- JSON nested deeper than an encoder takes (was a 500 from orjson) -----------------------------


def called(arguments: Any) -> list[dict[str, Any]]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."},
    ]


async def test_deep_tool_call_arguments_are_400(proxy, session):
    before = await snapshot(proxy)
    status, body = await send(proxy, "/v1/chat/completions", {"messages": called(nested(DEEP))}, session.api_key)
    assert status == 400 and body["error"]["param"].startswith("messages[1].tool_calls[0].function.arguments.a.a")
    assert_refused(status, body, body["error"]["param"])
    # the same JSON sent as a string: the shape is right, the normalizer bounds what it parses
    text = json.dumps(nested(DEEP))
    status, body = await send(proxy, "/v1/chat/completions", {"messages": called(text)}, session.api_key)
    assert_refused(status, body, "messages[1].tool_calls[0].function.arguments")
    assert await snapshot(proxy) == before


async def test_deep_tool_parameters_and_a_deep_message_name_are_400(proxy, session):
    before = await snapshot(proxy)
    tool = {"type": "function", "function": {"name": "f", "parameters": nested(DEEP)}}
    status, body = await send(proxy, "/v1/chat/completions", {"messages": USER, "tools": [tool]}, session.api_key)
    assert status == 400 and body["error"]["param"].startswith("tools[0].function.parameters.a.a")
    message = {**USER[0], "name": nested(DEEP)}
    status, body = await send(proxy, "/v1/chat/completions", {"messages": [message]}, session.api_key)
    assert status == 400 and body["error"]["param"].startswith("messages[0].name.a.a")
    status, body = await send(
        proxy, "/v1/chat/completions", {"messages": [{**USER[0], "name": {"a": 1}}]}, session.api_key
    )
    assert_refused(status, body, "messages[0].name")
    assert await snapshot(proxy) == before


@pytest.mark.parametrize(
    ("sample", "where", "param"),
    [
        ({"messages": USER, "extra": nested(DEEP)}, {}, "sample.extra.a"),
        ({"messages": USER}, {"context": nested(DEEP)}, "context.a"),
        (
            {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": nested(DEEP)}}]},
            {},
            "sample.tools[0].function.parameters.a",
        ),
        ({"messages": [{**USER[0], "name": nested(DEEP)}]}, {}, "sample.messages[0].name.a"),
        ({"messages": USER, "extra": {"text": "x" * (MAX_STRING_CHARS + 1)}}, {}, "sample.extra.text"),
    ],
)
async def test_session_fields_past_the_bounds_are_400_at_create(proxy, sample, where, param):
    """Were taken (201) by the memory store, then every read of the session was a 500."""
    before = await snapshot(proxy)
    status, body = await send(proxy, "/v1/sessions", {"sample": sample, **where})
    assert status == 400 and body["error"]["param"].startswith(param), body
    assert_refused(status, body, body["error"]["param"])
    assert await snapshot(proxy) == before


# -- an assistant message with neither content nor tool calls (was a 502, then a 400) -------------


async def test_an_assistant_message_without_content_or_tool_calls_is_an_empty_turn(proxy, session):
    """Every spelling of an empty answer (what a client that drops an empty content echoes of an answer that
    was all reasoning) renders as the assistant turn with content "": one prompt for all of them."""
    empty = [{"role": "assistant", "content": None}, {"role": "assistant"}, {"role": "assistant", "tool_calls": []}]
    for message in [{"role": "assistant", "content": ""}, *empty]:
        conversation = [*USER, message, {"role": "user", "content": "Well?"}]
        status, body = await send(proxy, "/v1/chat/completions", {"messages": conversation}, session.api_key)
        assert status == 200, body
    prompts = proxy.fake.prompts[-4:]
    assert all(prompt == prompts[0] for prompt in prompts)
    status, body = await send(proxy, "/v1/sessions", {"sample": {"messages": [*USER, *empty]}})
    assert status == 201, body
    before = await snapshot(proxy)  # a Responses message item needs its content, as the Responses API says
    status, body = await send(proxy, "/v1/responses", {"input": [*USER, {"role": "assistant"}]}, session.api_key)
    assert_refused(status, body, "input[1].content")
    assert await snapshot(proxy) == before


# -- chat_template_kwargs that override the proxy's rendering (taken, then every turn a 502) -------


@pytest.mark.parametrize(
    "kwargs", [{"messages": []}, {"add_generation_prompt": False}, {"tools": None}, {"chat_template": "{{ 1 }}"}]
)
async def test_template_kwargs_the_proxy_sets_are_400_at_create(proxy, kwargs):
    before = await snapshot(proxy)
    body = {"sample": {"messages": USER}, "generation": {"chat_template_kwargs": {"enable_thinking": False, **kwargs}}}
    status, answer = await send(proxy, "/v1/sessions", body)
    assert_refused(status, answer, f"generation.chat_template_kwargs.{next(iter(kwargs))}")
    assert await snapshot(proxy) == before


async def test_other_template_kwargs_are_still_taken(proxy):
    session = await proxy.create_session(USER, chat_template_kwargs={"enable_thinking": False})
    reply = await session.client.chat.completions.create(model="m", messages=USER)
    assert reply.choices[0].message.content


# -- injected messages count against the context (were stored past it) ---------------------------


async def test_injected_messages_past_the_context_are_400_and_store_nothing(proxy, session):
    before = await snapshot(proxy)
    long = {"role": "user", "content": "word " * 3000}  # ~3,000 tokens; the fake engine's context is 2,048
    status, body = await send(proxy, f"/v1/sessions/{session.session_id}/messages", {"messages": [*USER, long]})
    assert_refused(status, body, "messages", code="context_length_exceeded")
    assert await snapshot(proxy) == before
    # what fits is still injected
    status, body = await send(
        proxy, f"/v1/sessions/{session.session_id}/messages", {"messages": [*USER, {"role": "user", "content": "ok"}]}
    )
    assert status == 201, body


async def test_valid_tool_rounds_still_pass(proxy):
    """The validation layer takes what the SDK sends back: an echoed tool call and its result."""
    session = await proxy.create_session(USER, tools=[WEATHER_TOOL])
    proxy.fake.queue('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "Sunny.")
    first = await session.client.chat.completions.create(model="m", messages=USER, tools=[WEATHER_TOOL])
    echoed = first.choices[0].message.model_dump()
    tool_result = {"role": "tool", "tool_call_id": echoed["tool_calls"][0]["id"], "content": "21C"}
    second = await session.client.chat.completions.create(model="m", messages=[*USER, echoed, tool_result])
    assert (await proxy.trajectory(second.id))["turns"] == 2
