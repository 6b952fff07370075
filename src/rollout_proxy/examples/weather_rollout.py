"""Chat API + a custom tool, sync client (the template's ``weather_rollout.py``)."""

from __future__ import annotations

from typing import Optional

from rollout_proxy.examples.weather_tool import WEATHER_TOOL, run_tool_call
from rollout_proxy.sdk import (
    ChatCompletionSample,
    PluginContext,
    PluginInstance,
    PluginStatus,
    RolloutInferenceProxy,
    RolloutResult,
    Runtime,
    rollout,
)

LOCAL_TEST_MODEL = "smollm2"  # only used when testing against a plain endpoint
MAX_TURNS = 6


@rollout(
    name="weather_rollout",
    description="answers weather questions with a get_current_weather tool",
    runtime=Runtime(instance=PluginInstance.CPU4MEM8, timeout=900, max_concurrency=100),
)
def demo_rollout(
    context: PluginContext,
    proxy: RolloutInferenceProxy,
    sample: ChatCompletionSample,
) -> Optional[RolloutResult]:
    client = proxy.rollout_client()
    messages = [message.model_dump(exclude_none=True) for message in sample.messages]
    tools = sample.tools or [WEATHER_TOOL]
    follow_ups = list((sample.extra or {}).get("follow_ups", []))  # user turns to ask after each answer
    tool_calls = 0
    for _ in range(MAX_TURNS):
        completion = client.chat.completions.create(model=LOCAL_TEST_MODEL, messages=messages, tools=tools)
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            if not follow_ups:
                break
            messages.append({"role": "user", "content": follow_ups.pop(0)})
            continue
        for call in message.tool_calls:
            tool_calls += 1
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool_call(call.function.name, call.function.arguments)})
    return RolloutResult(status=PluginStatus.SUCCESS, error="", extra={"tool_calls": tool_calls})
