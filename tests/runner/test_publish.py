"""Publishing a step alone: the batch rule, GRPO or custom advantages, sample order, idempotence."""

from __future__ import annotations

import pytest

from rollout_proxy.runner.grading import grpo_advantages
from rollout_proxy.runner.publish import GradedGroup, StepPublisher
from rollout_proxy.runner.retries import JobFailed
from rollout_proxy.sdk.types import Trajectory
from rollout_proxy.state.feed import JsonlFeed
from rollout_proxy.state.redis_feed import RedisStreamFeed


@pytest.fixture(params=["jsonl", "redis"])
async def feed(request, tmp_path):
    if request.param == "jsonl":
        yield JsonlFeed(tmp_path / "feed.jsonl")
        return
    redis_feed = await RedisStreamFeed.connect(request.getfixturevalue("redis_url"), stream="test-publish")
    await redis_feed._redis.flushdb()
    yield redis_feed
    await redis_feed.close()


def graded(index: int, rewards: list[float], custom: tuple[str, list] | None = None, step: int = 0) -> GradedGroup:
    return GradedGroup(
        step=step,
        index=index,
        group_id=f"job/step-{step}/sample-{index}",
        sample={"messages": [{"role": "user", "content": f"q{index}"}]},
        trajectories=[Trajectory(messages=[{"role": "assistant", "content": str(r)}]) for r in rewards],
        rewards=rewards,
        grader_rewards={"g": rewards},
        metrics=[{"g/m": float(index)}],
        custom=custom,
    )


class Recorder:
    def __init__(self) -> None:
        self.seen: list[bool] = []

    def __call__(self, new: bool) -> None:
        self.seen.append(new)


async def test_groups_go_out_in_the_given_order_with_grpo_advantages(feed):
    told = Recorder()
    publisher = StepPublisher(feed, "job", on_published=told)
    groups = [graded(3, [1.0, 0.0, 0.5]), graded(1, [0.0, 0.0]), graded(2, [2.0])]
    ids = await publisher.publish_step(0, groups)
    assert all(ids) and told.seen == [True, True, True]
    entries = await feed.read()
    assert [entry.group.sample_index for entry in entries] == [3, 1, 2]
    first = entries[0].group
    assert first.job_id == "job" and first.advantage_kind == "grpo"
    assert first.advantages == pytest.approx(grpo_advantages([1.0, 0.0, 0.5]))
    assert first.grader_rewards == {"g": [1.0, 0.0, 0.5]} and first.metrics == [{"g/m": 3.0}]
    assert entries[1].group.advantages == [0.0, 0.0]  # equal rewards: nothing to learn
    assert entries[2].group.advantages == [2.0]  # a group of one keeps its raw reward


async def test_custom_advantages_replace_grpo(feed):
    publisher = StepPublisher(feed, "job")
    await publisher.publish_step(0, [graded(0, [1.0, 0.0], ("seq", [0.25, -0.25])), graded(1, [0.0], ("seq", [1.0]))])
    groups = [entry.group for entry in await feed.read()]
    assert [(g.advantage_kind, g.advantages) for g in groups] == [("seq", [0.25, -0.25]), ("seq", [1.0])]


async def test_a_batch_mixing_custom_and_grpo_fails_the_job_and_publishes_nothing(feed):
    publisher = StepPublisher(feed, "job")
    groups = [graded(0, [1.0, 0.0]), graded(1, [1.0, 0.0], ("seq", [0.5, 0.5])), graded(2, [0.0, 1.0])]
    with pytest.raises(JobFailed, match="step 4: 1 of 3 groups carry custom advantages"):
        await publisher.publish_step(4, groups)
    assert await feed.read() == []


async def test_an_empty_step_publishes_nothing(feed):
    assert await StepPublisher(feed, "job").publish_step(0, []) == []


async def test_publishing_a_step_again_publishes_nothing_twice(feed):
    told = Recorder()
    publisher = StepPublisher(feed, "job", on_published=told)
    await publisher.publish_step(0, [graded(0, [1.0, 0.0])])
    assert await publisher.published("job/step-0/sample-0") and not await publisher.published("job/step-0/sample-1")
    again = await publisher.publish_step(0, [graded(0, [1.0, 0.0]), graded(1, [0.0, 1.0])])
    assert again[0] is None and again[1] is not None and told.seen == [True, False, True]
    assert [entry.group.sample_index for entry in await feed.read()] == [0, 1]
