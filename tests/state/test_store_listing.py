"""The store's listing and tree reads (``list_sessions``, ``get_nodes``), over both stores;
then what only the Redis index has to get right (its own expiry, a lost script, a failed
index write after a committed finish)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from rollout_proxy.errors import InvalidRequest
from rollout_proxy.ids import new_session_id
from rollout_proxy.records import NodeKind, SessionRecord
from rollout_proxy.state import keys, listing
from rollout_proxy.state.listing import SessionSummary, everything
from rollout_proxy.state.redis import RedisStore
from tests.state.test_store_contract import node, put, session_record


def job_session(job: str = "job-1", step: int = 3, ttl: float = 60.0, created_at: float | None = None) -> SessionRecord:
    record = session_record(ttl)
    created = record.created_at if created_at is None else created_at
    return dataclasses.replace(
        record,
        created_at=created,
        expires_at=created + ttl,
        context={"model_customization_job_id": job, "current_training_step": step, "phase": "train"},
    )


async def all_pages(store, where=everything, limit=2) -> list[SessionSummary]:
    found, cursor = [], None
    for _ in range(100):
        page = await store.list_sessions(where, cursor=cursor, limit=limit)
        assert len(page.summaries) <= limit
        found += page.summaries
        cursor = page.next
        if cursor is None:
            return found
    raise AssertionError("the listing never ended")


async def test_sessions_are_listed_newest_first_each_once_across_pages(store):
    now = time.time()
    records = [job_session(created_at=now - 10 + index) for index in range(7)]
    for record in records:
        await store.create_session(record)
    listed = await all_pages(store, limit=3)
    assert [summary.session_id for summary in listed] == [record.id for record in reversed(records)]
    first = listed[0]
    assert (first.status, first.job_id, first.step, first.turns, first.finish_reasons) == ("open", "job-1", 3, 0, [])


async def test_sessions_created_at_the_same_instant_are_paged_without_loss_or_repeat(store):
    created = time.time()
    records = [job_session(created_at=created) for _ in range(5)]
    for record in records:
        await store.create_session(record)
    listed = await all_pages(store, limit=2)
    assert sorted(summary.session_id for summary in listed) == sorted(record.id for record in records)
    assert len(listed) == 5


async def test_the_filter_is_the_callers_and_a_long_scan_stops_with_a_cursor(store, monkeypatch):
    now = time.time()
    records = [job_session(job=f"job-{index % 2}", created_at=now - 10 + index) for index in range(8)]
    for record in records:
        await store.create_session(record)
    odd = await all_pages(store, lambda summary: summary.job_id == "job-1", limit=10)
    assert [summary.session_id for summary in odd] == [record.id for record in reversed(records[1::2])]
    monkeypatch.setattr(listing, "SCAN_LIMIT", 3)
    page = await store.list_sessions(lambda summary: False, limit=10)
    assert page.summaries == [] and page.next is not None  # looked at 3, more may match further on
    everything_after = await all_pages(store, limit=10)
    assert len(everything_after) == 8


async def test_a_finish_summarizes_the_whole_tree(store):
    record = job_session()
    await store.create_session(record)
    root = node(record.id, None, seed=1)
    root.finish_reason, root.created_at = "tool_calls", 1.0
    root.meta = {"policy_version": 4}
    await put(store, record.id, root)
    done = node(record.id, root.id, seed=2)
    done.finish_reason, done.created_at = "stop", 2.0
    done.meta = {"routing_disagreements": 2, "policy_versions": [{"version": 5, "start": 0, "end": 4}]}
    await put(store, record.id, done)
    forked = node(record.id, root.id, seed=3)
    forked.finish_reason, forked.created_at = "length", 3.0
    forked.fork = {"diverged_from": done.id, "at_message": 3}
    forked.meta = {"nonfinite_logprobs": 1}
    await put(store, record.id, forked)
    told = node(record.id, done.id, seed=4)
    told.kind, told.finish_reason, told.created_at = NodeKind.INJECTED, None, 4.0
    told.output_ids, told.output_logprobs = told.output_ids[:0], told.output_logprobs[:0]
    await put(store, record.id, told, latest="messages")
    (opened,) = (await store.list_sessions(everything)).summaries
    assert (opened.status, opened.turns, opened.forks) == ("open", 0, 0)  # nothing on a turn's path touches it

    result = {"status": "success", "error": None, "responses": [{"id": done.id, "extra": None}], "extra": {}}
    await store.finish_session(record.id, result)
    (summary,) = (await store.list_sessions(everything)).summaries
    assert summary.status == "finished" and summary.result_status == "success"
    assert summary.responses == [done.id]
    assert (summary.nodes, summary.turns, summary.injected) == (4, 3, 1)
    assert summary.tokens == 8 * 3 + 4 and summary.generated_tokens == 4 * 3
    # done has a child, but an injected one: it is still the last thing the policy generated there
    assert summary.finish_reasons == ["length", "stop"]
    assert (summary.forks, summary.routing_disagreements, summary.nonfinite_logprobs, summary.drift) == (1, 2, 1, 3)
    assert summary.policy_versions == ["4", "5"]
    assert (summary.job_id, summary.step) == ("job-1", 3)


async def test_get_nodes_reads_every_branch_of_one_session_only(store):
    record, other = session_record(), session_record()
    for item in (record, other):
        await store.create_session(item)
    root = node(record.id, None, seed=1)
    left, right = node(record.id, root.id, seed=2), node(record.id, root.id, seed=3)
    for index, item in enumerate((root, left, right)):
        item.created_at = float(index)
        await put(store, record.id, item)
    await put(store, other.id, node(other.id, None, seed=9))
    nodes = await store.get_nodes(record.id)
    assert [item.id for item in nodes] == [root.id, left.id, right.id]
    assert [item.parent_id for item in nodes] == [None, root.id, root.id]
    assert nodes[1].output_ids.tolist() == left.output_ids.tolist() and nodes[2].messages == right.messages
    assert await store.get_nodes(new_session_id()) is None
    assert len(await store.get_nodes(other.id)) == 1


async def test_expired_sessions_leave_the_listing(store):
    short, long = job_session(ttl=0.4), job_session(ttl=60)
    await store.create_session(short)
    await store.create_session(long)
    await asyncio.sleep(0.6)
    assert [summary.session_id for summary in await all_pages(store)] == [long.id]


@pytest.mark.parametrize("cursor", ["", "nonsense", "1.5", "nan~sess_x", "inf~sess_x", "1.5~"])
async def test_a_cursor_it_never_gave_out_is_a_400(store, cursor):
    with pytest.raises(InvalidRequest) as raised:
        await store.list_sessions(everything, cursor=cursor)
    assert raised.value.param == "cursor"


# -- the Redis index ---------------------------------------------------------------------------


@pytest.fixture
async def redis_store(redis_url):
    store = await RedisStore.connect(redis_url)
    await store._redis.flushdb()
    yield store
    await store.close()


async def test_the_redis_index_expires_with_its_sessions_and_is_trimmed_by_creates(redis_store):
    client = redis_store._redis
    gone = [job_session(ttl=0.3) for _ in range(3)]
    for record in gone:
        await redis_store.create_session(record)
    ttls = [await client.pttl(key) for key in keys.session_index_keys()]
    assert all(0 < ttl <= 300 for ttl in ttls), ttls  # no longer than its longest-lived session
    await asyncio.sleep(0.5)
    kept = job_session(ttl=60)
    await redis_store.create_session(kept)  # drops what expired before it
    assert await client.zrange(keys.session_index_key(), 0, -1) == [kept.id.encode()]
    assert list(await client.hgetall(keys.session_summary_key())) == [kept.id.encode()]
    assert 50_000 < await client.pttl(keys.session_index_key()) <= 60_000


async def test_a_server_that_lost_the_index_script_still_indexes(redis_store):
    await redis_store._redis.script_flush()
    record = job_session()
    await redis_store.create_session(record)
    assert [summary.session_id for summary in await all_pages(redis_store)] == [record.id]
    assert (await redis_store.get_session(record.id)).id == record.id


async def test_a_committed_finish_stands_when_its_index_write_fails(redis_store, monkeypatch):
    record = job_session()
    await redis_store.create_session(record)

    async def down(*args, **kwargs):
        raise RedisConnectionError("connection reset by peer")

    monkeypatch.setattr(redis_store, "_index_finish", down)
    finished = await redis_store.finish_session(record.id, {"status": "success", "responses": []})
    assert finished is not None and (await redis_store.get_session(record.id)).status.value == "finished"
    (stale,) = (await redis_store.list_sessions(everything)).summaries
    assert stale.status == "open"  # the view lags; the record (and the tree view) are the truth
