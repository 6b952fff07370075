"""A single grader for the weather demo: did the answer use the tool and state its result?"""

from __future__ import annotations

import json

from rollout_proxy.sdk import (
    ChatCompletionSample,
    PluginContext,
    PluginStatus,
    SingleGraderResult,
    Trajectory,
    single_grader,
    trace_monitor,
)


@single_grader(name="weather_reward")
@trace_monitor
def weather_reward(context: PluginContext, sample: ChatCompletionSample, trajectory: Trajectory) -> SingleGraderResult:
    messages = trajectory.messages
    tool_results = [
        json.loads(m["content"]) for m in messages if m.get("role") == "tool" and m.get("content", "").startswith("{")
    ]
    final = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
    used_tool = 1.0 if tool_results else 0.0
    mentions = 1.0 if any(str(r.get("condition", "")) in final for r in tool_results if "condition" in r) else 0.0
    return SingleGraderResult(
        reward=0.5 * used_tool + 0.5 * mentions,
        metrics={
            "used_tool": used_tool,
            "mentions_result": mentions,
            "assistant_turns": float(trajectory.assistant_turns),
        },
        status=PluginStatus.SUCCESS,
    )
