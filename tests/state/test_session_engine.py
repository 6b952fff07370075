"""A session's move to another engine (after a failover), over every store: one round trip, and it
lives and dies with the session. And a node's policy versions, stored compactly and read back."""

from __future__ import annotations

import asyncio

import numpy as np

from rollout_proxy.records import PolicySpan
from rollout_proxy.state.codec import decode_node, encode_node
from rollout_proxy.state.memory import MemoryStore
from tests.state.test_codec import make_node
from tests.state.test_store_contract import node, put, session_record


async def test_a_session_follows_the_engine_it_was_moved_to(store):
    record = session_record()
    await store.create_session(record)
    first = node(record.id, None)
    await put(store, record.id, first)
    await store.set_session_engine("sess_0000000000000000", "http://x")  # the script is loaded once per server
    calls = 0
    if not isinstance(store, MemoryStore):
        original = store._redis.execute_command

        async def counting(*args, **kwargs):
            nonlocal calls
            calls += 1
            return await original(*args, **kwargs)

        store._redis.execute_command = counting
    assert await store.set_session_engine(record.id, "http://engine-b:8000") is True
    if not isinstance(store, MemoryStore):
        store._redis.execute_command = original
        assert calls == 1
    moved = await store.get_session(record.id)
    assert moved.engine == "http://engine-b:8000"
    assert {**moved.to_dict(), "engine": record.engine} == record.to_dict()  # nothing else changed
    assert [n.id for n in await store.get_path(record.id, first.id)] == [first.id]
    finished = await store.finish_session(record.id, {"status": "success"})
    assert finished is not None and (await store.get_session(record.id)).engine == "http://engine-b:8000"


async def test_moving_a_session_that_is_gone_changes_nothing(store):
    record = session_record(ttl=0.5)
    assert await store.set_session_engine(record.id, "http://engine-b:8000") is False  # never created
    await store.create_session(record)
    await store.set_session_engine(record.id, "http://engine-b:8000")
    await asyncio.sleep(0.7)
    assert await store.set_session_engine(record.id, "http://engine-c:8000") is False
    assert await store.get_session(record.id) is None
    if not isinstance(store, MemoryStore):
        assert await store._redis.keys(f"rp:{{{record.id}}}:*") == []  # the engine key went with the session


def test_policy_versions_are_a_few_numbers_in_the_node_header():
    spans = (PolicySpan(3, 0, 5), PolicySpan(4, 5, 12))
    node_ = make_node(10, 12, policy_versions=spans)
    blob, _ = encode_node(node_)
    back = decode_node(blob)
    assert back.policy_versions == spans
    assert b'"versions":[[3,0,5],[4,5,12]]' in blob
    plain = make_node(10, 12)
    assert b"versions" not in encode_node(plain)[0] and decode_node(encode_node(plain)[0]).policy_versions == ()
    longer = make_node(10, 1012, policy_versions=(PolicySpan(3, 0, 1012),))  # one span, however many tokens
    assert len(encode_node(longer)[0]) - len(encode_node(make_node(10, 1012))[0]) < 40
    assert np.array_equal(back.output_ids, node_.output_ids)
