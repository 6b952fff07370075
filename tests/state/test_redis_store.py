"""What only the Redis store has to get right: a finish whose reply the connection lost."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
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

    def counting(blob, routing=None, **options):
        found = real_decode(blob, routing, **options)
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
            lease = await store.lease_session(record.id, ReadAhead(hashes=(chain[upto].path_hash,)))
            path = lease.take_path(chain[upto].id)
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


async def test_a_turns_read_walks_the_newest_of_siblings_that_share_a_path(redis_store):
    """A path-index entry naming several nodes (``a|b``): the read ahead walks the newest's path, and a later
    read of another sibling's path is a fresh one, not the one read ahead."""
    from rollout_proxy.state.store import NOT_READ, ReadAhead
    from tests.state.test_store_contract import node, put, session_record

    record = session_record()
    await redis_store.create_session(record)
    root = node(record.id, None, seed=1)
    await put(redis_store, record.id, root)
    older, newer = node(record.id, root.id, seed=2), node(record.id, root.id, seed=3)
    for sibling in (older, newer):
        await put(redis_store, record.id, sibling, paths={"p-same": sibling.id})
    ahead = ReadAhead(hashes=("p-same",))
    lease = await redis_store.lease_session(record.id, ahead)
    assert lease.leaf == newer.id and [n.id for n in lease.path] == [root.id, newer.id]
    assert lease.take_matches(["p-same"]) == [f"{newer.id}|{older.id}"]
    assert [n.id for n in lease.take_path(newer.id)] == [root.id, newer.id]
    lease = await redis_store.lease_session(record.id, ahead)
    assert lease.take_path(older.id) is NOT_READ  # another sibling's path: read from the store
    assert [n.id for n in await redis_store.get_path(record.id, older.id)] == [root.id, older.id]


async def test_node_blobs_are_stored_compressed_and_read_back_whatever_the_setting(redis_url):
    """A proxy restarted with another ``--redis-node-compression`` (or a second worker set otherwise)
    still reads every node already stored; a node's message text shrinks in Redis."""
    from rollout_proxy.state.codec import COMPRESSED_MAGIC, encode_node
    from rollout_proxy.state.connection import RedisOptions
    from rollout_proxy.state.keys import nodes_key
    from tests.state.test_store_contract import node, put

    packed = await RedisStore.connect(redis_url)
    plain = await RedisStore.connect(redis_url, options=RedisOptions(node_compression=0))
    try:
        record = session_record()
        await packed.create_session(record)
        text = "The tool printed this line, as tool results repeat themselves. " * 40
        first = replace(node(record.id, None, seed=1), messages=[{"role": "user", "content": text}])
        second = replace(
            node(record.id, first.id, seed=2), messages=[{"role": "tool", "tool_call_id": "c", "content": text}]
        )
        await put(packed, record.id, first)
        await put(plain, record.id, second)
        stored = await packed._redis.hgetall(nodes_key(record.id))
        assert stored[first.id.encode()].startswith(COMPRESSED_MAGIC)
        assert len(stored[first.id.encode()]) < 0.5 * len(encode_node(first)[0])
        assert stored[second.id.encode()] == encode_node(second)[0]  # level 0: the plain blob, byte for byte
        for reader in (packed, plain):
            path = await reader.get_path(record.id, second.id)
            assert [n.id for n in path] == [first.id, second.id]
            for back, sent in zip(path, (first, second), strict=True):
                assert back.messages == sent.messages
                assert np.array_equal(back.prompt_ids, sent.prompt_ids)
                assert np.array_equal(back.output_ids, sent.output_ids)
                assert np.array_equal(back.output_logprobs, sent.output_logprobs)
            assert {n.id for n in await reader.get_nodes(record.id)} == {first.id, second.id}  # same created_at
    finally:
        await packed.close()
        await plain.close()
