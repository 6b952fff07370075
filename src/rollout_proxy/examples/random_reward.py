"""A group grader with random rewards (the template's ``random_reward.py``)."""

from __future__ import annotations

import random

import numpy as np

from rollout_proxy.sdk import (
    ChatCompletionSample,
    GroupGraderResult,
    PluginContext,
    PluginStatus,
    Trajectory,
    group_grader,
)


@group_grader(name="random_reward")
def random_reward_fn(
    context: PluginContext, sample: ChatCompletionSample, trajectories: list[Trajectory]
) -> GroupGraderResult:
    rewards = [random.random() for _ in trajectories]
    metrics = {"test_mean": float(np.mean(rewards)), "test_std": float(np.std(rewards))}
    return GroupGraderResult(rewards=rewards, metrics=metrics, status=PluginStatus.SUCCESS, error="")
