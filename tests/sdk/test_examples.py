"""The seed's plugin examples, run against the proxy (fake engine) with only imports changed."""

from __future__ import annotations

import json

import numpy as np

from rollout_proxy.examples.async_weather_rollout import demo_rollout as async_weather_rollout
from rollout_proxy.examples.custom_advantage import custom_advantage_grader, token_advantage_grader
from rollout_proxy.examples.group_rollout import demo_group_rollout
from rollout_proxy.examples.random_reward import random_reward_fn
from rollout_proxy.examples.raw_rollout import raw_rollout
from rollout_proxy.examples.weather_rollout import demo_rollout as weather_rollout
from rollout_proxy.examples.weather_tool import WEATHER_TOOL
from rollout_proxy.sdk import (
    ChatCompletionSample,
    GroupGraderResult,
    PluginContext,
    PluginStatus,
    RolloutResult,
    Trajectory,
)
from tests.sdk.conftest import Stack

CONTEXT = PluginContext(phase="train", current_training_step=3)
WEATHER_SAMPLE = ChatCompletionSample(
    messages=[{"role": "user", "content": "北京天气怎么样"}],
    tools=[WEATHER_TOOL],
    max_new_tokens=256,
    extra={"answer": "sunny"},
)
TOOL_CALL = '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "北京"}}\n</tool_call>'


def weather_trajectory(stack: Stack, proxy, result: RolloutResult) -> Trajectory:
    finished = stack.finish(proxy, {"status": result.status.value, "extra": result.extra})
    (trajectory,) = finished["trajectories"]
    return Trajectory.model_validate(trajectory)


def check_weather(stack: Stack, proxy, result: RolloutResult) -> None:
    assert result.status == PluginStatus.SUCCESS and result.extra == {"tool_calls": 1}
    trajectory = weather_trajectory(stack, proxy, result)
    assert trajectory.turns == 2
    assert [m["role"] for m in trajectory.messages] == ["user", "assistant", "tool", "assistant"]
    assert json.loads(trajectory.messages[2]["content"])["location"] == "北京"
    # the plugin's own view matches the recorded conversation
    assert proxy.messages[-1]["content"] == trajectory.messages[-1]["content"] == "北京今天晴。"
    assert proxy.finish_reason == "stop" and proxy.usage["completion_tokens"] > 0
    weights = trajectory.loss_weight()
    assert weights.sum() == trajectory.usage["completion_tokens"]
    assert trajectory.extra == {"tool_calls": 1}


def test_weather_rollout_sync(stack: Stack):
    stack.fake.queue(TOOL_CALL, "北京今天晴。")
    proxy = stack.session(WEATHER_SAMPLE)
    result = weather_rollout(CONTEXT, proxy, WEATHER_SAMPLE)  # called exactly as the seed's main() does
    check_weather(stack, proxy, result)


async def test_weather_rollout_async(stack: Stack):
    stack.fake.queue(TOOL_CALL, "北京今天晴。")
    proxy = stack.session(WEATHER_SAMPLE)
    result = await async_weather_rollout(CONTEXT, proxy, WEATHER_SAMPLE)
    check_weather(stack, proxy, result)


async def test_sync_rollout_runs_in_a_thread_from_async_code(stack: Stack):
    stack.fake.queue(TOOL_CALL, "北京今天晴。")
    proxy = stack.session(WEATHER_SAMPLE)
    result = await weather_rollout.arun(CONTEXT, proxy, WEATHER_SAMPLE)
    check_weather(stack, proxy, result)


def test_raw_rollout_injects_the_reviewer_turn_with_weight_zero(stack: Stack):
    sample = ChatCompletionSample(messages=[{"role": "user", "content": "Explain gravity."}], max_new_tokens=128)
    stack.fake.queue("Gravity pulls masses toward each other, always and everywhere.", "Masses attract.")
    proxy = stack.session(sample)
    result = raw_rollout(CONTEXT, proxy, sample)
    trajectory = weather_trajectory(stack, proxy, result)
    assert trajectory.response_id == result.extra["final_id"]
    assert trajectory.turns == 2 and proxy.messages[-1]["content"] == "Masses attract."
    ids, weights = trajectory.token_ids(), trajectory.loss_weight()
    text_of = stack.fake.decode
    trained = text_of(ids[weights == 1].tolist())
    assert "Reviewer:" not in trained and "Masses attract." in trained
    assert "Reviewer: the answer has" in text_of(ids.tolist())


async def test_group_rollout_then_graders(stack: Stack):
    sample = ChatCompletionSample(messages=[{"role": "system", "content": "续写三字经。"}], max_new_tokens=64)
    stack.fake.queue("性本善。", "习相远。", "性乃迁。")
    proxy = stack.session(sample, n_sample=3)
    result = await demo_group_rollout(CONTEXT, proxy, sample, n_sample=3)
    assert result.status == PluginStatus.SUCCESS and len(result.responses) == 3
    finished = stack.finish(proxy, result.model_dump(mode="json"))
    trajectories = [Trajectory.model_validate(t) for t in finished["trajectories"]]
    first, second, third = (t.total_token_ids for t in trajectories)
    assert second[: len(first)] == first == third[: len(first)]
    # the shared first turn is trained once: by the first response naming it, weighted 0 in the two after it
    head = trajectories[0].loss_weight()
    assert head.sum() > 0 and all(not t.loss_weight()[: len(first)].any() for t in trajectories[1:])
    assert all(t.loss_weight()[len(first) :].sum() > 0 for t in trajectories[1:])
    assert trajectories[2].extra == {"reward": 1.0}

    random_result = random_reward_fn(CONTEXT, sample, trajectories)
    assert isinstance(random_result, GroupGraderResult) and len(random_result.rewards) == 3
    assert all(0.0 <= r <= 1.0 for r in random_result.rewards)

    custom = custom_advantage_grader(CONTEXT, sample, trajectories)
    assert custom.rewards == [0.0, 0.0, 1.0]
    # GRPO by hand: mean 1/3, sample std sqrt(1/3) (+1e-6)
    std = np.sqrt(((0 - 1 / 3) ** 2 * 2 + (1 - 1 / 3) ** 2) / 2) + 1e-6
    assert np.allclose(custom.seq_advantages, [(-1 / 3) / std, (-1 / 3) / std, (2 / 3) / std])
    tokens = token_advantage_grader(CONTEXT, sample, trajectories)
    assert [len(values) for values in tokens.tok_advantages] == [len(t.total_token_ids) for t in trajectories]
