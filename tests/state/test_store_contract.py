"""The StateStore contract, run over every implementation (memory and a real Redis)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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
from rollout_proxy.state.store import NOT_READ, SIBLINGS, Idempotency, ReadAhead, RequestBound
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


async def test_a_sessions_policy_roundtrips_and_a_base_sessions_record_has_none(store):
    """A LoRA session keeps its policy through a read and a finish; a base session's stored record is as it was
    before policies (no ``policy`` key), and reads back as the base's."""
    lora, base = dataclasses.replace(session_record(), policy="grpo-lora"), session_record()
    await store.create_session(lora)
    await store.create_session(base)
    assert (await store.get_session(lora.id)).policy == "grpo-lora"
    assert (await store.get_session(base.id)).policy == "base" and "policy" not in base.to_dict()
    lease = await store.lease_session(lora.id, ReadAhead())  # what a turn reads
    assert lease is not None and lease.session.policy == "grpo-lora"
    finished = await store.finish_session(lora.id, {"status": "success"})
    assert finished.policy == "grpo-lora" and (await store.get_session(lora.id)).policy == "grpo-lora"


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


# -- a turn's session read: SessionLease ------------------------------------------------------------


async def test_a_lease_answers_what_it_read_ahead_once_as_of_the_read_and_nothing_after_its_write(store):
    record = session_record()
    await store.create_session(record)
    root = node(record.id, None, seed=1)
    await put(store, record.id, root)
    lease = await store.lease_session(record.id, ReadAhead(hashes=("h1", "h2")))
    assert lease.session.to_dict() == record.to_dict() and lease.slot is None
    child = node(record.id, root.id, seed=2)
    await put(store, record.id, child)  # not through the lease: what it read stays as of its read
    assert lease.take_matches(["h1", "h2"]) == [root.id, None]
    assert lease.take_matches(["h1", "h2"]) is NOT_READ  # once: a later read is the store's
    assert await store.match_paths(record.id, ["h1", "h2"]) == [root.id, child.id]
    assert [n.id for n in lease.take_path(root.id)] == [root.id]  # the deepest whole-node match's path
    assert lease.take_path(root.id) is NOT_READ
    # other hashes than those read ahead use them up, and are the store's to answer
    lease = await store.lease_session(record.id, ReadAhead(hashes=("h1",)))
    assert lease.take_matches(["h2"]) is NOT_READ and lease.take_matches(["h1"]) is NOT_READ
    # a node written through the lease drops what it read ahead
    lease = await store.lease_session(record.id, ReadAhead(response_id=child.id))
    assert lease.leaf == child.id and lease.take_path(root.id) is NOT_READ
    await store.put_node(
        record.id, node(record.id, child.id, seed=3), paths={}, partial_paths={}, latest=None, lease=lease
    )
    assert lease.take_path(child.id) is NOT_READ
    # a response id that is not in the session is read ahead as absent
    missing = new_response_id(record.id)
    lease = await store.lease_session(record.id, ReadAhead(response_id=missing))
    assert lease.take_path(missing) is None
    assert await store.lease_session(new_session_id(), ReadAhead()) is None


def bounded_record(key: str, limit: int = 1) -> SessionRecord:
    record = session_record()
    record.concurrency = {"key": key, "max_requests": limit}
    return record


async def all_free(store, key: str, limit: int) -> bool:
    """Whether ``limit`` slots of ``key`` can be held at once (nothing left behind): a slot that goes back
    when its task ends goes back in the background, so soon rather than at once."""
    async with asyncio.timeout(5), contextlib.AsyncExitStack() as held:
        for _ in range(limit):
            await held.enter_async_context(store.request_slot(key, limit, lease=30.0))
    return True


async def test_a_slot_taken_with_the_read_goes_back_at_the_write_at_close_or_when_its_task_ends(store):
    if getattr(store, "_cluster", False):
        pytest.skip("a cluster's session read takes no slot (state.redis): the turn takes it at its engine call")
    key = f"job-{new_session_id()}"
    record = bounded_record(key)
    await store.create_session(record)
    bound = RequestBound(key, 1)
    lease = await store.lease_session(record.id, ReadAhead(bound=bound))
    assert lease.slot is not None and lease.slot.held and lease.slot.key == key
    async with asyncio.timeout(1), store.request_slot(key, 1, lease=30.0, taken=lease.slot):
        pass  # the turn's own slot: no wait
    other = await store.lease_session(record.id, ReadAhead(bound=bound))
    assert other.slot is None  # the bound is full: that turn waits for a slot at its engine call
    root = node(record.id, None, seed=1)
    await put(store, record.id, root)  # not through the lease: its slot stays held
    assert lease.slot.held
    await store.put_node(
        record.id, node(record.id, root.id, seed=2), paths={}, partial_paths={}, latest=None, lease=lease
    )
    assert not lease.slot.held and await all_free(store, key, 1)
    # closed without a write (a turn refused after its read): given back, once
    lease = await store.lease_session(record.id, ReadAhead(bound=bound))
    assert lease.slot is not None
    await lease.close()
    await lease.close()
    assert not lease.slot.held and await all_free(store, key, 1)

    # a task that ends without a write or a close gives it back, whatever ended it
    async def read_and_fail() -> None:
        taken = await store.lease_session(record.id, ReadAhead(bound=bound))
        assert taken.slot is not None
        raise RuntimeError("the turn failed")

    with pytest.raises(RuntimeError):
        await asyncio.create_task(read_and_fail())
    assert await all_free(store, key, 1)


async def test_no_slot_is_taken_for_a_session_that_is_not_open_or_not_of_that_bound(store):
    key = f"job-{new_session_id()}"
    bound = RequestBound(key, 1)
    finished = bounded_record(key)
    await store.create_session(finished)
    await store.finish_session(finished.id, {"status": "success"})
    other = bounded_record(f"other-{key}")
    await store.create_session(other)
    for session_id in (finished.id, other.id):
        lease = await store.lease_session(session_id, ReadAhead(bound=bound))
        assert lease is not None and lease.slot is None
    assert await store.lease_session(new_session_id(), ReadAhead(bound=bound)) is None
    assert await all_free(store, key, 1)
