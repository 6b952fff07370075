"""Plugins for the OPD runner test: one model call, a teacher with context, a critic context."""

from __future__ import annotations

from typing import Any, cast

from openai.types.chat import ChatCompletionMessageParam

from rollout_proxy.sdk import (
    ChatCompletionSample,
    PluginContext,
    PluginInstance,
    PluginStatus,
    RolloutInferenceProxy,
    RolloutResult,
    Runtime,
    SingleGraderResult,
    Trajectory,
    rollout,
    single_grader,
)

HINT = {"qa_index": 0, "message": {"role": "user", "content": "Reference: it is sunny."}}


@rollout(name="opd_rollout", runtime=Runtime(instance=PluginInstance.CPU2MEM4, timeout=30, max_concurrency=4))
async def opd_rollout(
    context: PluginContext, proxy: RolloutInferenceProxy, sample: ChatCompletionSample
) -> RolloutResult:
    client = proxy.async_rollout_client()
    messages = cast(list[ChatCompletionMessageParam], sample.message_dicts())
    await client.chat.completions.create(model="m", messages=messages)
    teacher: dict[str, Any] = (sample.extra or {}).get("teacher") or "math"
    return RolloutResult(
        status=PluginStatus.SUCCESS,
        config={"teachers": {teacher: {"teacher_context": [HINT]}}, "critic_context": [HINT]},
    )


@single_grader(name="length_grader", runtime=Runtime(instance=PluginInstance.CPU2MEM4, timeout=30))
def length_grader(context: PluginContext, sample: ChatCompletionSample, trajectory: Trajectory) -> SingleGraderResult:
    """A reward that differs between generations: the answer's length in tokens."""
    return SingleGraderResult(reward=float((trajectory.usage or {}).get("completion_tokens", 0)))
