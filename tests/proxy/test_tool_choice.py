"""``tool_choice`` on the three APIs alike: checked as each API takes it (a malformed one is a 400 naming
``tool_choice``, nothing stored), accepted and not enforced (the policy samples freely), and, when it asks for
more than ``auto``, recorded on the node (``meta.tool_choice``) and echoed by a Responses answer, streamed or
not."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_proxy.proxy import keys
from tests.harness import ProxyHarness, store_snapshot

pytestmark = pytest.mark.parametrize("template_name", ["qwen3_style"], indirect=False)

QUESTION = "What is the weather in Paris?"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": PARAMETERS}
MESSAGES_TOOL = {"name": "get_weather", "input_schema": PARAMETERS}


def chat(choice: Any) -> tuple[str, dict[str, Any]]:
    body = {"model": "m", "messages": [{"role": "user", "content": QUESTION}], "tools": [CHAT_TOOL]}
    return "/v1/chat/completions", {**body, "tool_choice": choice}


def responses(choice: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/responses", {"model": "m", "input": QUESTION, "tools": [RESPONSES_TOOL], "tool_choice": choice}


def messages(choice: Any) -> tuple[str, dict[str, Any]]:
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": QUESTION}]}
    return "/v1/messages", {**body, "tools": [MESSAGES_TOOL], "tool_choice": choice}


FORCED = [
    (chat, "required"),
    (chat, {"type": "function", "function": {"name": "get_weather"}}),
    (chat, "none"),
    (responses, "required"),
    (responses, {"type": "function", "name": "get_weather"}),
    (responses, {"type": "web_search_preview"}),  # a hosted tool's type: accepted as OpenAI names it
    (messages, {"type": "any"}),
    (messages, {"type": "tool", "name": "get_weather"}),
]
MALFORMED = [
    (chat, "sometimes"),
    (chat, {"type": "function"}),
    (chat, {"type": "function", "function": {"name": ""}}),
    (chat, ["auto"]),
    (responses, "always"),
    (responses, {"type": "function", "function": {"name": "get_weather"}}),  # Chat's shape on Responses
    (responses, {"name": "get_weather"}),
    (messages, "any"),
    (messages, {"type": "tool"}),
]


def named(cases: list[tuple[Any, Any]]) -> list[Any]:
    return [pytest.param(api, choice, id=f"{api.__name__}-{choice}") for api, choice in cases]


@pytest.mark.parametrize(("api", "choice"), named(FORCED))
async def test_a_tool_choice_is_accepted_and_recorded_on_the_node(proxy: ProxyHarness, api: Any, choice: Any):
    session = await proxy.create_session([], max_new_tokens=64)
    path, body = api(choice)
    status, answer = await proxy.request("POST", path, json=body, token=session.api_key)
    assert status == 200, answer
    (node,) = await proxy.app[keys.STORE].get_nodes(session.session_id) or []
    assert node.meta["tool_choice"] == choice
    if api is responses:
        assert answer["tool_choice"] == choice


@pytest.mark.parametrize("api", [chat, responses, messages])
async def test_auto_is_not_recorded(proxy: ProxyHarness, api: Any):
    session = await proxy.create_session([], max_new_tokens=64)
    path, body = api({"type": "auto"} if api is messages else "auto")
    status, answer = await proxy.request("POST", path, json=body, token=session.api_key)
    assert status == 200, answer
    (node,) = await proxy.app[keys.STORE].get_nodes(session.session_id) or []
    assert "tool_choice" not in node.meta
    if api is responses:
        assert answer["tool_choice"] == "auto"


async def test_a_streamed_responses_turn_echoes_its_tool_choice(proxy: ProxyHarness):
    session = await proxy.create_session([], max_new_tokens=64)
    choice = {"type": "function", "name": "get_weather"}
    async with session.client.responses.stream(
        model="m", input=QUESTION, tools=[RESPONSES_TOOL], tool_choice=choice
    ) as stream:
        created = None
        async for event in stream:
            if event.type == "response.created":
                created = event.response
        final = await stream.get_final_response()
    assert created is not None and created.tool_choice.model_dump(exclude_none=True) == choice
    assert final.tool_choice.model_dump(exclude_none=True) == choice


@pytest.mark.parametrize(("api", "choice"), named(MALFORMED))
async def test_a_malformed_tool_choice_is_a_400_naming_it_and_stores_nothing(
    proxy: ProxyHarness, api: Any, choice: Any
):
    session = await proxy.create_session([], max_new_tokens=64)
    before = await store_snapshot(proxy.app[keys.STORE])
    path, body = api(choice)
    status, answer = await proxy.request("POST", path, json=body, token=session.api_key)
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith("tool_choice"), error
    assert await store_snapshot(proxy.app[keys.STORE]) == before
