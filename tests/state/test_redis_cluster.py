"""The store, the trainer feed and its consumer on a real three-master Redis Cluster.

The same tests as on one Redis server, collected here a second time with ``redis_url`` (and
the store and feed fixtures) pointing at the cluster (``redis+cluster://``): every multi-key
script and transaction keeps its keys in one slot (``state.keys``'s hash tags), or the cluster
would refuse it with CROSSSLOT. A proxy turn on the cluster keeps to two round trips too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio.cluster import RedisCluster

from rollout_proxy.errors import StoreBusy
from rollout_proxy.state.connection import RedisOptions
from rollout_proxy.state.feed import open_feed
from rollout_proxy.state.redis import RedisStore
from rollout_proxy.state.redis_feed import RedisStreamFeed
from tests.runner.test_feed import (  # noqa: F401 (collected again, on the cluster)
    test_a_consumer_that_crashes_gets_its_entries_again_and_nobody_gets_them_twice,
    test_publish_is_idempotent_and_read_pages_in_order,
)
from tests.state.test_request_slots import (  # noqa: F401
    test_bounds_with_other_keys_are_apart,
    test_no_more_than_the_limit_hold_a_slot_at_once,
)
from tests.state.test_round_trips import (  # noqa: F401
    proxy,
    sends,
    test_a_slot_comes_back_when_the_turn_fails,
    test_a_slot_taken_with_the_read_bounds_the_engine_calls,
    test_chat_turns_make_at_most_two_redis_round_trips,
    test_responses_turns_after_a_previous_response_make_at_most_two_round_trips,
)
from tests.state.test_session_engine import (  # noqa: F401
    test_a_session_follows_the_engine_it_was_moved_to,
    test_moving_a_session_that_is_gone_changes_nothing,
)
from tests.state.test_store_contract import *  # noqa: F403 (collected again, on the cluster)
from tests.state.test_store_contract import session_record
from tests.state.test_store_listing import (  # noqa: F401
    test_a_finish_summarizes_the_whole_tree,
    test_expired_sessions_leave_the_listing,
    test_get_nodes_reads_every_branch_of_one_session_only,
    test_sessions_are_listed_newest_first_each_once_across_pages,
)


@pytest.fixture
def redis_url(redis_cluster_url: str) -> str:
    return redis_cluster_url


@pytest.fixture
async def store(redis_cluster_url: str) -> AsyncIterator[RedisStore]:
    cluster_store = await RedisStore.connect(redis_cluster_url)
    assert isinstance(cluster_store._redis, RedisCluster)
    await cluster_store._redis.flushdb(target_nodes=RedisCluster.PRIMARIES)
    yield cluster_store
    await cluster_store.close()


@pytest.fixture
async def redis_feed(redis_cluster_url: str) -> AsyncIterator[RedisStreamFeed]:
    feed = await RedisStreamFeed.connect(redis_cluster_url, stream="test-feed")
    await feed._redis.flushdb(target_nodes=RedisCluster.PRIMARIES)
    yield feed
    await feed.close()


@pytest.fixture
async def feed(redis_cluster_url: str) -> AsyncIterator[object]:
    opened = await open_feed(redis_cluster_url, stream="test-feed")
    assert isinstance(opened, RedisStreamFeed)
    await opened._redis.flushdb(target_nodes=RedisCluster.PRIMARIES)
    yield opened
    await opened.close()


async def test_a_small_cluster_pool_makes_concurrent_calls_wait_not_fail(redis_cluster_url: str) -> None:
    """redis-py's cluster pools fail at once when full; the store waits for a connection instead."""
    small = await RedisStore.connect(redis_cluster_url, options=RedisOptions(max_connections=2, pool_timeout=30.0))
    try:
        records = [session_record() for _ in range(64)]
        await asyncio.gather(*(small.create_session(record) for record in records))
        found = await asyncio.gather(*(small.get_session(record.id) for record in records))
        assert [session.id for session in found if session is not None] == [record.id for record in records]
    finally:
        await small.close()


async def test_a_cluster_pool_wait_that_runs_out_is_store_busy(redis_cluster_url: str) -> None:
    small = await RedisStore.connect(redis_cluster_url, options=RedisOptions(max_connections=1, pool_timeout=0.1))
    try:
        assert small._gate is not None
        async with small._gate.held():  # the only connection, busy elsewhere
            with pytest.raises(StoreBusy) as raised:
                await small.get_session("sess_0000000000000000")
        assert raised.value.status == 503 and raised.value.retry_after
        assert await small.get_session("sess_0000000000000000") is None  # free again: answers
    finally:
        await small.close()
