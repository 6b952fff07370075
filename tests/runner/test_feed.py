"""The trainer feed: published once, read in order, at least once through a consumer group."""

from __future__ import annotations

import asyncio

import pytest

from rollout_proxy.runner import JobConfig, run_job
from rollout_proxy.state.feed import JsonlFeed
from rollout_proxy.state.redis_feed import RedisStreamFeed
from rollout_proxy.trainer import FeedGroup, TrajectoryConsumer
from tests.harness import ADMIN_KEY, ProxyHarness
from tests.runner.conftest import write_dataset, write_job


def group(n: int, group_id: str | None = None) -> FeedGroup:
    """A small published group whose sample index says which one it is."""
    return FeedGroup(
        group_id=group_id or f"g{n}",
        job_id="job",
        step=0,
        sample_index=n,
        trajectories=[],
        rewards=[],
        advantages=[],
        advantage_kind="grpo",
    )


@pytest.fixture
async def redis_feed(redis_url):
    feed = await RedisStreamFeed.connect(redis_url, stream="test-feed")
    await feed._redis.flushdb()
    yield feed
    await feed.close()


@pytest.fixture(params=["jsonl", "redis"])
async def feed(request, tmp_path):
    if request.param == "jsonl":
        yield JsonlFeed(tmp_path / "feed.jsonl")
        return
    redis_feed = await RedisStreamFeed.connect(request.getfixturevalue("redis_url"), stream="test-feed")
    await redis_feed._redis.flushdb()
    yield redis_feed
    await redis_feed.close()


async def test_publish_is_idempotent_and_read_pages_in_order(feed):
    ids = [await feed.publish(group(n)) for n in range(5)]
    assert all(ids) and await feed.publish(group(9, group_id="g2")) is None
    assert await feed.published("g4") and not await feed.published("g9")
    first = await feed.read(limit=2)
    rest = await feed.read(after=first[-1].id, limit=10)
    assert [entry.group.sample_index for entry in first + rest] == [0, 1, 2, 3, 4]


async def test_a_consumer_that_crashes_gets_its_entries_again_and_nobody_gets_them_twice(redis_feed, redis_url):
    for n in range(6):
        await redis_feed.publish(group(n))
    options = {"stream": "test-feed", "group": "trainers", "batch": 3, "block_ms": 50}
    crashed = TrajectoryConsumer(redis_url, consumer="trainer-a", **options)
    got = await crashed.fetch()
    assert [e.group.sample_index for e in got] == [0, 1, 2]
    await crashed.ack(got[0])
    await crashed.close()  # dies with entries 1 and 2 unacknowledged

    second = TrajectoryConsumer(redis_url, consumer="trainer-b", claim_idle_ms=60_000, **options)
    seen_by_second = [e async for e in _drain(second)]
    assert [e.group.sample_index for e in seen_by_second] == [3, 4, 5]  # not the crashed one's pending entries

    restarted = TrajectoryConsumer(redis_url, consumer="trainer-a", **options)
    again = await restarted.fetch()
    assert [e.group.sample_index for e in again] == [1, 2]  # its unacknowledged entries come back
    await restarted.close()

    # entries of a consumer that stays dead are claimed by another after claim_idle_ms
    await asyncio.sleep(0.15)
    rescuer = TrajectoryConsumer(redis_url, consumer="trainer-c", claim_idle_ms=100, **options)
    rescued = await rescuer.fetch()
    assert [e.group.sample_index for e in rescued] == [1, 2]
    for entry in rescued:
        await rescuer.ack(entry)
    assert await rescuer.fetch() == []
    assert [e.group.sample_index for e in await second.fetch()] == []  # trainer-b acked all it had: nothing twice
    await rescuer.close()
    await second.close()


async def _drain(consumer: TrajectoryConsumer):
    while entries := await consumer.fetch():
        for entry in entries:
            await consumer.ack(entry)
            yield entry


async def test_runner_publishes_to_a_redis_stream_read_by_a_trainer(engine, tmp_path, redis_url, redis_feed):
    dataset = write_dataset(tmp_path / "train.jsonl", ["ok"] * 3)
    job = JobConfig.load(
        write_job(
            tmp_path,
            dataset=dataset,
            graders=[("position_grader", 1.0)],
            engine_url=engine.url,
            batch_size=3,
            num_generations=2,
        )
    )
    job.proxy.feed_stream = "test-feed"
    summary = await run_job(job, feed=redis_url, store=redis_url, progress=False)
    assert summary.groups_published == 3 and summary.feed == redis_url
    async with TrajectoryConsumer(
        redis_url, stream="test-feed", group="t", consumer="c", block_ms=50, stop_when_idle=True
    ) as trainer:
        groups = [entry async for entry in trainer]
    assert [g.group.sample_index for g in groups] == [0, 1, 2]
    assert all(len(g.group.trajectories) == 2 and g.group.advantages for g in groups)


async def test_http_pull_endpoint_pages_with_a_cursor(fake_engine, tmp_path):
    feed_path = tmp_path / "feed.jsonl"
    writer = JsonlFeed(feed_path)
    for n in range(5):
        await writer.publish(group(n))
    async with ProxyHarness.running(engine_urls=[fake_engine.url], feed=f"jsonl:{feed_path}") as proxy:
        status, page = await proxy.request("GET", "/v1/feed?limit=2")
        assert status == 200 and [e["data"]["sample_index"] for e in page["entries"]] == [0, 1]
        status, page = await proxy.request("GET", f"/v1/feed?after={page['next']}&limit=10")
        assert [e["data"]["sample_index"] for e in page["entries"]] == [2, 3, 4] and page["next"] == "5"
        status, page = await proxy.request("GET", "/v1/feed?after=5")
        assert page == {"entries": [], "next": "5"}
        status, body = await proxy.request("GET", "/v1/feed?limit=0")
        assert status == 400 and body["error"]["param"] == "limit"
        session = await proxy.create_session([{"role": "user", "content": "hi"}])
        status, body = await proxy.request("GET", "/v1/feed", token=session.api_key)
        assert status == 401
    async with ProxyHarness.running(engine_urls=[fake_engine.url]) as proxy:
        status, body = await proxy.request("GET", "/v1/feed", token=ADMIN_KEY)
        assert status == 404 and "--feed" in body["error"]["message"]
