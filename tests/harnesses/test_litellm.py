"""litellm 1.110.2's documented tool loop, unmodified, over its OpenAI provider against a session: ``completion``
and ``acompletion``, plain and ``stream=True`` (the answer rebuilt with ``stream_chunk_builder``), with and
without thinking; the task is the session's sample, the system prompt the client's own.

The loop appends the assistant message litellm returns (``{"role": "assistant", "tool_calls": [...]}``, no
``content`` key, its ``reasoning_content`` when there is one), then a ``tool`` message per call, and asks
again. litellm reads its model cost map from the package, not the network (``LITELLM_LOCAL_MODEL_COST_MAP``,
read at its import), and sends no telemetry.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_TELEMETRY", "False")
import litellm

from devtools.fake_engine import FakeEngine
from rollout_proxy.proxy import keys
from tests.harness import ProxyHarness
from tests.harnesses.conftest import assert_exact, session_trajectory

litellm.telemetry = False
TASK = "What's the weather like in Paris and Tokyo?"
SYSTEM = "You are a weather assistant."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "description": "Get the current weather in a given location",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "The city"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["location"],
            },
        },
    }
]
CALLS = "\n".join(
    f'<tool_call>\n{{"name": "get_current_weather", "arguments": {{"location": "{city}"}}}}\n</tool_call>'
    for city in ("Paris", "Tokyo")
)
ANSWER = "Paris is 22C and Tokyo is 10C."
WEATHER = {"Paris": {"temperature": "22", "unit": "celsius"}, "Tokyo": {"temperature": "10", "unit": "celsius"}}


def get_current_weather(location: str, unit: str = "celsius") -> str:
    return json.dumps({"location": location, **WEATHER[location]})


async def ask(how: str, messages: list[Any], **options: Any) -> Any:
    """One litellm call as ``how`` says, the answer as the loop reads it."""
    if how == "completion":
        return await asyncio.to_thread(litellm.completion, messages=messages, **options)
    if how == "completion_stream":

        def streamed() -> Any:
            chunks = list(litellm.completion(messages=messages, stream=True, **options))
            return litellm.stream_chunk_builder(chunks, messages=messages)

        return await asyncio.to_thread(streamed)
    if how == "acompletion":
        return await litellm.acompletion(messages=messages, **options)
    chunks = [chunk async for chunk in await litellm.acompletion(messages=messages, stream=True, **options)]
    return litellm.stream_chunk_builder(chunks, messages=messages)


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no_thinking"])
@pytest.mark.parametrize("how", ["completion", "completion_stream", "acompletion", "acompletion_stream"])
async def test_litellm_tool_loop_is_recorded_exactly(proxy: ProxyHarness, fake: FakeEngine, how: str, thinking: bool):
    sample = {
        "messages": [{"role": "user", "content": TASK}],
        "thinking": {"type": "enabled" if thinking else "disabled"},
    }
    status, session = await proxy.request(
        "POST", "/v1/sessions", json={"sample": sample, "generation": {"max_new_tokens": 256}}
    )
    assert status == 201, session
    fake.queue(f"<think>\nTwo cities, two calls.\n</think>\n\n{CALLS}" if thinking else CALLS, ANSWER)
    options = {"model": "openai/policy", "api_base": session["base_url"], "api_key": session["api_key"]}
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]

    response = await ask(how, messages, tools=TOOLS, tool_choice="auto", **options)
    message = response.choices[0].message
    assert [call.function.name for call in message.tool_calls] == ["get_current_weather"] * 2
    assert (message.get("reasoning_content") == "Two cities, two calls.") is thinking
    messages.append(message)
    for call in message.tool_calls:
        arguments = json.loads(call.function.arguments)
        result = get_current_weather(location=arguments["location"], unit=arguments.get("unit", "celsius"))
        messages.append({"tool_call_id": call.id, "role": "tool", "name": call.function.name, "content": result})
    second = await ask(how, messages, tools=TOOLS, **options)
    assert second.choices[0].message.content == ANSWER

    trajectory = await session_trajectory(proxy, session)
    assert_exact(trajectory, fake, task=TASK, turns=2)
    roles = [message["role"] for message in trajectory["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert trajectory["messages"][0]["content"] == SYSTEM
    path = await proxy.app[keys.STORE].get_path(session["session_id"], trajectory["response_id"])
    assert len(path) == 2 and path[1].parent_id == path[0].id and path[1].fork is None
    assert all("sample_placement" not in node.meta and "parent_ambiguity" not in node.meta for node in path)
