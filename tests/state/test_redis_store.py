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


async def test_a_turns_read_brings_only_the_nodes_below_the_path_this_worker_holds(redis_url, monkeypatch):
    """Two workers on one Redis: each holds the latest path it saw; a turn's read brings only newer nodes."""
    from rollout_proxy.state import redis as redis_module
    from rollout_proxy.state.store import ReadAhead
    from tests.state.test_store_contract import node, put, session_record

    decoded: list[str] = []
    real_decode = redis_module.decode_node

    def counting(blob, routing=None):
        found = real_decode(blob, routing)
        decoded.append(found.id)
        return found

    monkeypatch.setattr(redis_module, "decode_node", counting)
    first, second = await RedisStore.connect(redis_url), await RedisStore.connect(redis_url)
    try:
        record = session_record()
        await first.create_session(record)
        chain = []
        for seed in range(4):
            item = node(record.id, chain[-1].id if chain else None, seed=seed)
            await put(first, record.id, item)
            chain.append(item)

        async def turn(store, upto: int) -> list[str]:
            decoded.clear()
            await store.get_session(record.id, read_ahead=ReadAhead(hashes=(chain[upto].path_hash,)))
            path = await store.get_path(record.id, chain[upto].id)
            assert [n.id for n in path] == [n.id for n in chain[: upto + 1]]
            return list(decoded)

        assert await turn(first, 3) == []  # it wrote them all: it holds the path
        assert await turn(second, 1) == [chain[0].id, chain[1].id]  # the first read of another worker: all
        assert await turn(second, 3) == [chain[2].id, chain[3].id]  # then only what was added below
        assert await turn(second, 3) == []
        assert await turn(second, 2) == [chain[0].id, chain[1].id, chain[2].id]  # not below it: read whole
        sibling = node(record.id, chain[1].id, seed=9)  # a branch: the path held stays the other one
        await put(first, record.id, sibling)
        assert await turn(first, 3) == []
        chain[2] = sibling
        assert await turn(first, 2) == [chain[0].id, chain[1].id, sibling.id]  # then this one is held
        assert await turn(first, 2) == []
    finally:
        await first.close()
        await second.close()
