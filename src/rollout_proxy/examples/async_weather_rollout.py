"""Chat API + a custom tool, async client (the template's ``async_weather_rollout.py``)."""

from __future__ import annotations

from typing import cast

from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from rollout_proxy.examples.weather_tool import WEATHER_TOOL, follow_reply
from rollout_proxy.sdk import (
    ChatCompletionSample,
    PluginContext,
    PluginInstance,
    PluginStatus,
    RolloutInferenceProxy,
    RolloutResult,
    Runtime,
    rollout,
    trace_monitor,
    wrap_inplace_trace,
)

LOCAL_TEST_MODEL = "smollm2"
MAX_TURNS = 6


@rollout(
    name="async_weather_rollout",
    runtime=Runtime(instance=PluginInstance.CPU4MEM8, timeout=900, max_concurrency=100),
)
@trace_monitor
async def demo_rollout(
    context: PluginContext,
    proxy: RolloutInferenceProxy,
    sample: ChatCompletionSample,
) -> RolloutResult | None:
    client = proxy.async_rollout_client()
    wrap_inplace_trace(client)  # a span per LLM call (the seed's tracing)
    # the sample's JSON messages and tools, typed as what the OpenAI client takes
    messages = cast(list[ChatCompletionMessageParam], [m.model_dump(exclude_none=True) for m in sample.messages])
    tools = cast(list[ChatCompletionToolParam], sample.tools or [WEATHER_TOOL])
    follow_ups = list((sample.extra or {}).get("follow_ups", []))  # user turns to ask after each answer
    tool_calls = 0
    for _ in range(MAX_TURNS):
        completion = await client.chat.completions.create(model=LOCAL_TEST_MODEL, messages=messages, tools=tools)
        reply = completion.choices[0].message.model_dump(exclude_none=True)
        messages.append(cast(ChatCompletionMessageParam, reply))
        more, calls = follow_reply(reply, follow_ups)
        if not more:
            break
        messages += more
        tool_calls += calls
    return RolloutResult(status=PluginStatus.SUCCESS, error="", extra={"tool_calls": tool_calls})
