"""The demo's tool: a deterministic fake weather service."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from openai.types.chat import ChatCompletionMessageParam

from rollout_proxy.sdk import observe

CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy"]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "获取指定地点的天气信息 (current weather for a place)",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "地点的位置信息，例如北京、上海"},
                "unit": {"type": "string", "enum": ["摄氏度", "华氏度"], "description": "温度单位"},
            },
            "required": ["location"],
        },
    },
}


@observe()
def get_current_weather(location: str, unit: str = "摄氏度") -> str:
    digest = hashlib.sha256(location.strip().lower().encode()).digest()
    celsius = digest[0] % 35 - 5
    value = celsius if unit != "华氏度" else round(celsius * 9 / 5 + 32)
    return json.dumps(
        {"location": location, "temperature": value, "unit": unit, "condition": CONDITIONS[digest[1] % 5]},
        ensure_ascii=False,
    )


def run_tool_call(name: str, arguments: str) -> str:
    if name != "get_current_weather":
        return json.dumps({"error": f"unknown tool {name}"})
    try:
        kwargs = json.loads(arguments or "{}")
        return get_current_weather(**kwargs)
    except (ValueError, TypeError) as exc:
        return json.dumps({"error": f"bad arguments: {exc}"})


def follow_reply(message: Mapping[str, Any], follow_ups: list[str]) -> tuple[list[ChatCompletionMessageParam], int]:
    """What the agent appends after a reply: tool results, else the next follow-up question.

    Returns (messages to append, tool calls made); no messages means the episode is over.
    """
    calls = message.get("tool_calls") or []
    if calls:
        results: list[ChatCompletionMessageParam] = [
            {
                "role": "tool",
                "tool_call_id": call["id"],
                "content": run_tool_call(call["function"]["name"], call["function"]["arguments"]),
            }
            for call in calls
        ]
        return results, len(calls)
    if follow_ups:
        return [{"role": "user", "content": follow_ups.pop(0)}], 0
    return [], 0
