"""The trainer feed's entries: one graded group of trajectories each.

The runner publishes ``FeedGroup``s; the Redis Stream / JSONL feed stores them as JSON;
``GET /v1/feed`` pages them as ``{"id", "data"}``; the trainer's ``TrajectoryConsumer``
yields ``FeedEntry``s (the entry id, for acknowledging, and the typed group).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollout_proxy.wire.trajectory import Trajectory


class FeedGroup(BaseModel):
    """A sample's graded trajectories with their rewards and advantages."""

    model_config = ConfigDict(extra="allow")

    group_id: str
    job_id: str
    step: int
    sample_index: int
    sample: dict[str, Any] = Field(default_factory=dict)
    trajectories: list[Trajectory]
    rewards: list[float]
    grader_rewards: dict[str, list[float]] = Field(default_factory=dict)
    #: one per trajectory ("grpo", "seq") or one per token of each trajectory ("tok")
    advantages: list[Any]
    advantage_kind: str
    metrics: list[dict[str, float]] = Field(default_factory=list)
    #: the oldest and newest policy version of any generated token in the group (None: not known)
    oldest_policy_version: int | None = None
    newest_policy_version: int | None = None
    #: how many groups the runner published in this step: a trainer's step is complete when it has them all
    step_groups: int | None = None
    #: kept although its oldest token was more than ``max_staleness`` versions old when published
    stale: bool = False

    def sequences(self) -> list[tuple[int, Trajectory]]:
        """(rollout index, sequence) for every sequence of every rollout of the group: a rollout's reward and
        advantage (``rewards[i]``, ``advantages[i]``) are those of each of its sequences, and every sampled
        token is trained (loss weight 1) in exactly one of them (``Trajectory.branches``)."""
        return [
            (index, sequence) for index, rollout in enumerate(self.trajectories) for sequence in rollout.sequences()
        ]


class FeedEntry(BaseModel):
    """One entry of the feed as a trainer reads it: its id (the cursor, what to ack) and the group."""

    id: str
    group: FeedGroup

    @property
    def group_id(self) -> str:
        return self.group.group_id
