"""Publishing a step: the batch rule, each group's advantages, the feed in sample order.

A step's groups are published together once all are graded: first the batch rule
(all or none of its groups carry custom advantages, the same rule as
``sdk.validation.check_advantage_batch``, per group), then, in sample order, each
group with its custom advantages or, without them, GRPO advantages of its rewards.
The feed is idempotent by group id, so publishing a step again (a resumed job)
publishes nothing twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_proxy.runner.grading import grpo_advantages
from rollout_proxy.runner.retries import JobFailed
from rollout_proxy.sdk.types import Trajectory
from rollout_proxy.state.feed import Feed
from rollout_proxy.wire.feed import FeedGroup, FeedImage
from rollout_proxy.wire.trajectory import PolicyVersionSpan


@dataclass(slots=True)
class GradedGroup:
    """A sample's trajectories, graded, waiting for its step to be published."""

    step: int
    index: int
    group_id: str
    sample: dict[str, Any]
    trajectories: list[Trajectory]
    rewards: list[float]
    grader_rewards: dict[str, list[float]]
    metrics: list[dict[str, float]]
    custom: tuple[str, list[Any]] | None
    stale: bool = False  # kept although older than max_staleness allows (stale_groups: keep)
    images: dict[str, FeedImage] = field(default_factory=dict)  # the bytes of the images the trajectories name

    def policy_versions(self) -> tuple[int | None, int | None]:
        """The oldest and newest policy version of any generated token (None: no spans)."""
        return version_range(self.trajectories)

    def oldest_by_policy(self) -> dict[str, int]:
        """The oldest version of each policy that sampled tokens of the group (a job's sessions name one)."""
        oldest: dict[str, int] = {}
        for span in _spans(self.trajectories):
            oldest[span.policy] = min(span.version, oldest.get(span.policy, span.version))
        return oldest

    def advantages(self) -> tuple[str, list[Any]]:
        """(kind, advantages): the custom ones, else GRPO over the rewards."""
        return self.custom if self.custom is not None else ("grpo", grpo_advantages(self.rewards))

    def entry(self, job_id: str, *, step_groups: int | None = None) -> FeedGroup:
        kind, advantages = self.advantages()
        oldest, newest = self.policy_versions()
        return FeedGroup(
            group_id=self.group_id,
            job_id=job_id,
            step=self.step,
            sample_index=self.index,
            sample=self.sample,
            trajectories=self.trajectories,
            rewards=self.rewards,
            grader_rewards=self.grader_rewards,
            advantages=advantages,
            advantage_kind=kind,
            metrics=self.metrics,
            oldest_policy_version=oldest,
            newest_policy_version=newest,
            step_groups=step_groups,
            stale=self.stale,
            images=self.images,
        )


def version_range(trajectories: Sequence[Trajectory]) -> tuple[int | None, int | None]:
    """(oldest, newest) policy version over the trajectories' spans; (None, None) without any."""
    versions = [span.version for span in _spans(trajectories)]
    return (min(versions), max(versions)) if versions else (None, None)


def _spans(trajectories: Sequence[Trajectory]) -> Iterator[PolicyVersionSpan]:
    for trajectory in trajectories:
        for sequence in trajectory.sequences():
            yield from sequence.policy_versions


def check_batch(step: int, groups: Sequence[GradedGroup]) -> None:
    """All or none of a step's groups carry custom advantages; else the job fails."""
    customised = [group.custom is not None for group in groups]
    if any(customised) and not all(customised):
        raise JobFailed(
            f"step {step}: {sum(customised)} of {len(groups)} groups carry custom advantages; "
            "a batch must use custom advantages for all of its groups or for none"
        )


def _ignore(new: bool) -> None:
    return None


class StepPublisher:
    """Puts a job's graded steps on the trainer feed."""

    def __init__(self, feed: Feed, job_id: str, *, on_published: Callable[[bool], None] = _ignore) -> None:
        """``on_published(new)`` is told of each group: new, or already on the feed."""
        self._feed = feed
        self._job_id = job_id
        self._on_published = on_published

    async def published(self, group_id: str) -> bool:
        return await self._feed.published(group_id)

    async def publish_step(self, step: int, groups: Sequence[GradedGroup]) -> list[str | None]:
        """Check the batch rule, then publish in the given (sample) order; the entry ids (None: already there)."""
        check_batch(step, groups)
        entry_ids = []
        for group in groups:
            entry_id = await self._feed.publish(group.entry(self._job_id, step_groups=len(groups)))
            self._on_published(entry_id is not None)
            entry_ids.append(entry_id)
        return entry_ids
