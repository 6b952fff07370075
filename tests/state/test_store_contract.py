"""The StateStore contract, run over every implementation (memory and a real Redis)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from rollout_proxy.errors import IdempotencyKeyReused, InvalidRequest, SessionFinished, SessionNotFound
from rollout_proxy.ids import new_response_id, new_session_id
from rollout_proxy.records import (
    GenerationConfig,
    NodeKind,
    ResponseNode,
    SessionRecord,
    SessionStatus,
    TeacherScores,
    TopLogprobs,
)
from rollout_proxy.state.codec import BlobCompressor
from rollout_proxy.state.memory import MemoryStore
from rollout_proxy.state.store import SIBLINGS, Idempotency
from tests.harness import store_snapshot


def session_record(ttl: float = 60.0) -> SessionRecord:
    now = time.time()
    return SessionRecord(
        id=new_session_id(),
        messages=[{"role": "user", "content": "hi"}],
        tools=None,
        extra={"answer": 4},
        generation=GenerationConfig(max_new_tokens=8),
        context={"phase": "train"},
        created_at=now,
        expires_at=now + ttl,
        engine="http://engine",
    )


def node(session_id: str, parent_id: str | None, n_tokens: int = 4, seed: int = 0) -> ResponseNode:
    rng = np.random.default_rng(seed)
    return ResponseNode(
        id=new_response_id(session_id),
        parent_id=parent_id,
        kind=NodeKind.GENERATED,
        api="chat",
        messages=[{"role": "user", "content": f"q{seed}"}, {"role": "assistant", "content": f"a{seed}"}],
        n_input_messages=1,
        prompt_ids=rng.integers(0, 1000, n_tokens, dtype=np.int32),
        output_ids=rng.integers(0, 1000, n_tokens, dtype=np.int32),
        output_logprobs=-rng.random(n_tokens, dtype=np.float32),
        path_hash=f"h{seed}",
    )


async def put(store, session_id, item, latest="chat", paths=None, partial=None, idempotency=None):
    return await store.put_node(
        session_id,
        item,
        paths=paths or {item.path_hash: item.id},
        partial_paths=partial or {},
        latest=latest,
        idempotency=idempotency,
    )


async def test_sessions_roundtrip(store):
    record = session_record()
    await store.create_session(record)
    assert (await store.get_session(record.id)).to_dict() == record.to_dict()
    assert await store.get_session(new_session_id()) is None
    finished = await store.finish_session(record.id, {"status": "success", "responses": []})
    assert finished.status.value == "finished" and finished.result == {"status": "success", "responses": []}
    assert (await store.get_session(record.id)).to_dict() == finished.to_dict()
    # only once, and never for an unknown session
    assert await store.finish_session(record.id, {"status": "failure"}) is None
    assert await store.finish_session(new_session_id(), {"status": "success"}) is None


async def test_concurrent_finishes_succeed_once(store):
    record = session_record()
    await store.create_session(record)
    results = await asyncio.gather(*(store.finish_session(record.id, {"n": n}) for n in range(8)))
    winners = [result for result in results if result is not None]
    assert len(winners) == 1
    assert (await store.get_session(record.id)).result == winners[0].result


async def test_path_is_root_to_leaf_and_siblings_share_the_parent(store):
    record = session_record()
    await store.create_session(record)
    root_child = node(record.id, None, seed=1)
    await put(store, record.id, root_child)
    left, right = node(record.id, root_child.id, seed=2), node(record.id, root_child.id, seed=3)
    await put(store, record.id, left)
    await put(store, record.id, right)
    left_path = await store.get_path(record.id, left.id)
    right_path = await store.get_path(record.id, right.id)
    assert [n.id for n in left_path] == [root_child.id, left.id]
    assert [n.id for n in right_path] == [root_child.id, right.id]
    assert np.array_equal(left_path[0].output_ids, root_child.output_ids)
    assert await store.latest(record.id, "chat") == right.id
    assert await store.latest(record.id, "*") == right.id
    assert await store.latest(record.id, "responses") is None
    assert await store.get_path(record.id, new_response_id(record.id)) is None


async def test_paths_stay_exact_while_branches_interleave(store):
    """Reads and writes alternating between branches: every path is its own, whatever the store keeps."""
    record = session_record()
    await store.create_session(record)
    trunk = [node(record.id, None, seed=0)]
    await put(store, record.id, trunk[0])
    for seed in range(1, 4):
        trunk.append(node(record.id, trunk[-1].id, seed=seed))
        await put(store, record.id, trunk[-1])
    fork = node(record.id, trunk[1].id, seed=10)  # a branch from the middle, written after the trunk
    await put(store, record.id, fork)
    more = node(record.id, trunk[-1].id, seed=11)  # the trunk goes on after the fork
    await put(store, record.id, more)
    expected = {
        fork.id: [trunk[0].id, trunk[1].id, fork.id],
        more.id: [n.id for n in trunk] + [more.id],
        trunk[2].id: [trunk[0].id, trunk[1].id, trunk[2].id],
        trunk[0].id: [trunk[0].id],
    }
    for leaf in [fork.id, more.id, fork.id, trunk[2].id, more.id, trunk[0].id, more.id]:
        path = await store.get_path(record.id, leaf)
        assert [n.id for n in path] == expected[leaf]
        path.pop()  # the caller's list: changing it changes nothing stored
    assert [n.id for n in await store.get_path(record.id, more.id)] == expected[more.id]


async def test_ids_are_scoped_to_their_session(store):
    mine, other = session_record(), session_record()
    await store.create_session(mine)
    await store.create_session(other)
    item = node(mine.id, None)
    await put(store, mine.id, item)
    assert await store.get_path(other.id, item.id) is None
    assert await store.match_paths(other.id, [item.path_hash]) == [None]


async def test_partial_path_entries_never_overwrite(store):
    record = session_record()
    await store.create_session(record)
    first = node(record.id, None, seed=1)
    await put(store, record.id, first, paths={"p-end": first.id}, partial={"p-mid": f"{first.id}#1"})
    second = node(record.id, None, seed=2)
    await put(
        store,
        record.id,
        second,
        paths={"p-other": second.id},
        partial={"p-end": f"{second.id}#1", "p-mid": f"{second.id}#1"},
    )
    assert await store.match_paths(record.id, ["p-mid", "p-end", "p-other", "nope"]) == [
        f"{first.id}#1",
        first.id,
        second.id,
        None,
    ]
    # a full entry overwrites a partial one, and keeps the nodes of a full one behind it, newest first
    third = node(record.id, None, seed=3)
    await put(store, record.id, third, paths={"p-end": third.id, "p-mid": third.id})
    assert await store.match_paths(record.id, ["p-end", "p-mid"]) == [f"{third.id}|{first.id}", third.id]


async def test_a_full_path_entry_keeps_at_most_siblings_nodes(store):
    """Nodes whose paths end at one hash (a group's samples with the same answer): the newest SIBLINGS."""
    record = session_record()
    await store.create_session(record)
    written = []
    for seed in range(SIBLINGS + 2):
        sibling = node(record.id, None, seed=seed)
        await put(store, record.id, sibling, paths={"p-end": sibling.id})
        written.append(sibling.id)
    [entry] = await store.match_paths(record.id, ["p-end"])
    assert entry is not None and entry.split("|") == written[::-1][:SIBLINGS]


async def test_session_and_nodes_expire_together(store):
    record = session_record(ttl=0.6)
    await store.create_session(record)
    item = node(record.id, None)
    await put(store, record.id, item)
    await asyncio.sleep(0.8)
    assert await store.get_session(record.id) is None
    assert await store.get_path(record.id, item.id) is None
    assert await store.match_paths(record.id, [item.path_hash]) == [None]
    with pytest.raises(SessionNotFound):
        await put(store, record.id, node(record.id, None, seed=5))


async def test_deep_path_costs_one_round_trip_and_nodes_do_not_grow_with_depth(store):
    """A 100-turn branch is one read; a node's size follows its tokens, not its depth."""
    record = session_record()
    await store.create_session(record)
    parent_id = None
    nodes = []
    for depth in range(100):
        item = node(record.id, parent_id, n_tokens=50, seed=depth)
        await put(store, record.id, item)
        nodes.append(item)
        parent_id = item.id
    calls = 0
    if not isinstance(store, MemoryStore):
        original = store._redis.execute_command

        async def counting(*args, **kwargs):
            nonlocal calls
            calls += 1
            return await original(*args, **kwargs)

        store._redis.execute_command = counting
        path = await store.get_path(record.id, parent_id)
        store._redis.execute_command = original
        assert calls == 1
        stored = [await store._redis.hget(f"rp:{{{record.id}}}:nodes", item.id) for item in nodes]
        plain = [BlobCompressor(0).decompress(blob) for blob in stored]  # as stored, compressed or not
        deeper = [len(blob) for blob in plain[1:]]  # the first has no parent id
        assert max(deeper) - min(deeper) <= 8  # only message digits may differ
        assert all(len(blob) <= len(original) for blob, original in zip(stored, plain, strict=True))
    else:
        path = await store.get_path(record.id, parent_id)
    assert [n.id for n in path] == [n.id for n in nodes]


async def test_a_finished_session_takes_no_more_nodes(store):
    """The finish and a late turn race in the store: whichever is first, the finished result
    never gains a node after it was recorded."""
    record = session_record()
    await store.create_session(record)
    first = node(record.id, None, seed=1)
    assert await store.put_node(record.id, first, paths={"h1": first.id}, partial_paths={}, latest="chat") == first.id
    assert await store.finish_session(record.id, {"status": "success"}) is not None
    before = await store_snapshot(store)
    late = node(record.id, first.id, seed=2)
    with pytest.raises(SessionFinished):
        await put(store, record.id, late, idempotency=Idempotency("k", "f"))
    assert await store_snapshot(store) == before
    assert await store.get_path(record.id, late.id) is None
    assert await store.latest(record.id, "*") == first.id


async def test_an_idempotency_key_names_one_node(store):
    record = session_record()
    await store.create_session(record)
    claim = Idempotency("key-1", "fingerprint-a")
    first, again = node(record.id, None, seed=1), node(record.id, None, seed=2)
    assert await put(store, record.id, first, idempotency=claim) == first.id
    before = await store_snapshot(store)
    assert await put(store, record.id, again, idempotency=claim) == first.id  # nothing written
    assert await store_snapshot(store) == before
    assert await store.get_path(record.id, again.id) is None
    with pytest.raises(IdempotencyKeyReused):
        await put(store, record.id, node(record.id, None, seed=3), idempotency=Idempotency("key-1", "fingerprint-b"))
    assert await store_snapshot(store) == before
    # another key, or the same key in another session, is another request
    other = node(record.id, None, seed=4)
    assert await put(store, record.id, other, idempotency=Idempotency("key-2", "fingerprint-a")) == other.id
    elsewhere = session_record()
    await store.create_session(elsewhere)
    theirs = node(elsewhere.id, None, seed=5)
    assert await put(store, elsewhere.id, theirs, idempotency=claim) == theirs.id


async def test_concurrent_writes_with_one_key_make_one_node(store):
    record = session_record()
    await store.create_session(record)
    claim = Idempotency("same", "fingerprint")
    candidates = [node(record.id, None, seed=seed) for seed in range(8)]
    stored = await asyncio.gather(*(put(store, record.id, item, idempotency=claim) for item in candidates))
    assert len(set(stored)) == 1 and stored[0] in {item.id for item in candidates}
    assert [await store.get_path(record.id, item.id) is not None for item in candidates].count(True) == 1


async def test_a_result_json_cannot_encode_changes_nothing(store):
    record = session_record()
    await store.create_session(record)
    deep: dict = {}
    for _ in range(300):
        deep = {"d": deep}
    before = await store_snapshot(store)
    with pytest.raises(InvalidRequest):
        await store.finish_session(record.id, {"status": "success", "extra": deep})
    assert await store_snapshot(store) == before
    assert (await store.get_session(record.id)).status is SessionStatus.OPEN


async def test_nothing_of_a_session_is_left_after_its_ttl_untouched(store):
    """Memory comes back after the TTL without any request touching the session
    (the memory store's timer ticks every second; Redis expires the keys itself)."""
    record = session_record(ttl=0.3)
    await store.create_session(record)
    item = node(record.id, None)
    await put(store, record.id, item, idempotency=Idempotency("k", "f"))
    await store.finish_session(record.id, {"status": "success"})
    await asyncio.sleep(1.5)
    assert record.id not in str(await store_snapshot(store))


def teacher_scores(n: int, k: int | None) -> TeacherScores:
    rng = np.random.default_rng(n)
    logprobs = -rng.random(n, dtype=np.float32)
    logprobs[::3] = np.nan  # untrained tokens
    topk = None
    if k is not None:
        rows = int((~np.isnan(logprobs)).sum())
        topk = TopLogprobs(rng.integers(0, 50000, (rows, k), dtype=np.int32), -rng.random((rows, k), dtype=np.float32))
    return TeacherScores(teacher="math", logprobs=logprobs, topk=topk, n_tokens_injected=7)


async def test_a_teacher_pass_is_kept_per_response_and_expires_with_its_session(store):
    record = session_record(ttl=0.6)
    await store.create_session(record)
    item = node(record.id, None)
    await put(store, record.id, item)
    assert await store.get_teacher_scores(record.id, item.id) is None
    first, second = teacher_scores(10, None), teacher_scores(12, 3)
    assert await store.put_teacher_scores(record.id, item.id, first)
    assert await store.put_teacher_scores(record.id, item.id, second)  # a later pass replaces it
    kept = await store.get_teacher_scores(record.id, item.id)
    assert kept is not None and kept.teacher == "math" and kept.n_tokens_injected == 7
    assert np.array_equal(kept.logprobs, second.logprobs, equal_nan=True) and kept.logprobs.dtype == np.float32
    assert kept.topk is not None and second.topk is not None
    assert np.array_equal(kept.topk.ids, second.topk.ids) and np.array_equal(kept.topk.logprobs, second.topk.logprobs)
    await asyncio.sleep(0.8)
    assert await store.get_teacher_scores(record.id, item.id) is None
    assert not await store.put_teacher_scores(record.id, item.id, first)  # the session is gone: nothing written
    assert record.id not in str(await store_snapshot(store))
