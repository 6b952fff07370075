"""Custom Advantages (the seed's example): GRPO's normalisation done in the grader."""

from __future__ import annotations

import math

from rollout_proxy.sdk import (
    ChatCompletionSample,
    GroupGraderResult,
    PluginContext,
    PluginStatus,
    Trajectory,
    group_grader,
)


def _rewards(trajectories: list[Trajectory]) -> list[float]:
    return [
        trajectory.extra["reward"] if trajectory.extra and "reward" in trajectory.extra else 0.0
        for trajectory in trajectories
    ]


def _seq_advantages(rewards: list[float]) -> list[float]:
    count = len(rewards)
    if count > 1:
        reward_mean = sum(rewards) / count
        variance = sum((reward - reward_mean) ** 2 for reward in rewards) / (count - 1)
        reward_std = math.sqrt(variance) + 1e-6
    else:
        reward_mean = 0.0
        reward_std = 1.0
    return [(reward - reward_mean) / reward_std for reward in rewards]


@group_grader(name="custom_advantage_grader")
def custom_advantage_grader(
    context: PluginContext,
    sample: ChatCompletionSample,
    trajectories: list[Trajectory],
) -> GroupGraderResult:
    rewards = _rewards(trajectories)
    return GroupGraderResult(
        rewards=rewards,
        status=PluginStatus.SUCCESS,
        error="",
        metrics={},
        seq_advantages=_seq_advantages(rewards),
    )


@group_grader(name="token_advantage_grader")
def token_advantage_grader(
    context: PluginContext,
    sample: ChatCompletionSample,
    trajectories: list[Trajectory],
) -> GroupGraderResult:
    rewards = _rewards(trajectories)
    seq_advantages = _seq_advantages(rewards)
    tok_advantages = []
    for index, trajectory in enumerate(trajectories):
        assert trajectory.total_loss_weight is not None
        token_count = len(trajectory.total_loss_weight)
        token_values = [seq_advantages[index] for _ in range(token_count)]
        tok_advantages.append(token_values)
    return GroupGraderResult(
        rewards=rewards, status=PluginStatus.SUCCESS, error="", metrics={}, tok_advantages=tok_advantages
    )
