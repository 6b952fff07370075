"""What only the Redis store has to get right: a finish whose reply the connection lost."""

from __future__ import annotations

import pytest
from redis.asyncio.client import Pipeline
from redis.exceptions import WatchError

from rollout_proxy.state.redis import RedisStore
from tests.state.test_store_contract import session_record


@pytest.fixture
async def redis_store(redis_url):
    store = await RedisStore.connect(redis_url)
    await store._redis.flushdb()
    yield store
    await store.close()


async def test_a_finish_whose_exec_reply_was_lost_is_still_a_success(redis_store, monkeypatch):
    """redis-py turns a connection lost during a WATCHed transaction into WatchError: if the EXEC
    had committed, the re-read finds our own result, and that is our success, not a 409."""
    record = session_record()
    await redis_store.create_session(record)
    original = Pipeline.execute
    lost: list[bool] = []

    async def commit_then_lose_the_reply(self, *args, **kwargs):
        result = await original(self, *args, **kwargs)
        if not lost:
            lost.append(True)
            raise WatchError("connection lost after EXEC")
        return result

    monkeypatch.setattr(Pipeline, "execute", commit_then_lose_the_reply)
    finished = await redis_store.finish_session(record.id, {"status": "success", "extra": {"k": 1}})
    assert lost and finished is not None and finished.result == {"status": "success", "extra": {"k": 1}}
    # another finish is still refused: only our own committed result counts as ours
    assert await redis_store.finish_session(record.id, {"status": "failure"}) is None
