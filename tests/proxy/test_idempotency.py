"""``POST /v1/sessions/{id}/messages`` with an ``Idempotency-Key``: one node per key.

Without a key, identical concurrent appends each make a node (documented behaviour:
nothing tells them apart); with one, they make one node and all answer its id.
"""

from __future__ import annotations

import asyncio

import pytest

from rollout_proxy.proxy import keys
from rollout_proxy.state.memory import MemoryStore
from tests.harness import ProxyHarness, store_snapshot

USER = [{"role": "user", "content": "Look this up"}]
TOOL_RESULT = [{"role": "user", "content": "the search returned 3 results"}]
CONCURRENT = 8


@pytest.fixture
def template_name() -> str:
    return "qwen3_style"  # the template plays no part here: one is enough


async def node_ids(store, session_id: str) -> set[str]:
    if isinstance(store, MemoryStore):
        return set(store._sessions[session_id].nodes)
    return {key.decode() for key in await store._redis.hkeys(f"rp:{{{session_id}}}:nodes")}


async def append(proxy: ProxyHarness, session, messages, *, key: str | None = None, previous: str | None = None):
    return await proxy.request(
        "POST",
        f"/v1/sessions/{session.session_id}/messages",
        json={"messages": messages, "previous_response_id": previous},
        token=session.api_key,
        headers={"Idempotency-Key": key} if key is not None else None,
    )


async def test_concurrent_appends_with_one_key_make_one_node(proxy: ProxyHarness):
    session = await proxy.create_session(USER)
    answers = await asyncio.gather(*(append(proxy, session, TOOL_RESULT, key="k-1") for _ in range(CONCURRENT)))
    assert {status for status, _ in answers} == {201}
    assert all(body == answers[0][1] for _, body in answers)
    assert await node_ids(proxy.app[keys.STORE], session.session_id) == {answers[0][1]["response_id"]}
    # a retry later gets the same answer and writes nothing
    before = await store_snapshot(proxy.app[keys.STORE])
    assert await append(proxy, session, TOOL_RESULT, key="k-1") == answers[0]
    assert await store_snapshot(proxy.app[keys.STORE]) == before


async def test_concurrent_appends_after_a_parent_with_one_key_make_one_node(proxy: ProxyHarness):
    """With ``previous_response_id`` a retry is placed anew each time: only the key stops a second node."""
    session = await proxy.create_session(USER)
    status, first = await append(proxy, session, TOOL_RESULT)
    assert status == 201
    more = [{"role": "user", "content": "and one more"}]
    answers = await asyncio.gather(
        *(append(proxy, session, more, key="k-2", previous=first["response_id"]) for _ in range(CONCURRENT))
    )
    assert {status for status, _ in answers} == {201}
    assert len({body["response_id"] for _, body in answers}) == 1
    assert len(await node_ids(proxy.app[keys.STORE], session.session_id)) == 2
    assert await append(proxy, session, more, key="k-2", previous=first["response_id"]) == answers[0]
    assert len(await node_ids(proxy.app[keys.STORE], session.session_id)) == 2


async def test_a_key_sent_again_with_another_body_is_409_and_changes_nothing(proxy: ProxyHarness):
    session = await proxy.create_session(USER)
    status, _ = await append(proxy, session, TOOL_RESULT, key="k-3")
    assert status == 201
    before = await store_snapshot(proxy.app[keys.STORE])
    status, body = await append(proxy, session, [{"role": "user", "content": "something else"}], key="k-3")
    assert status == 409, body
    assert body["error"]["code"] == "idempotency_key_reused" and body["error"]["param"] == "Idempotency-Key"
    assert await store_snapshot(proxy.app[keys.STORE]) == before


async def test_without_a_key_identical_concurrent_appends_each_make_a_node(proxy: ProxyHarness):
    """Documented behaviour: without a key, nothing tells a retry from a second request
    (after a ``previous_response_id``, each append is placed as new messages)."""
    session = await proxy.create_session(USER)
    status, first = await append(proxy, session, TOOL_RESULT)
    assert status == 201
    more = [{"role": "user", "content": "and one more"}]
    answers = await asyncio.gather(
        *(append(proxy, session, more, previous=first["response_id"]) for _ in range(CONCURRENT))
    )
    assert {status for status, _ in answers} == {201}
    assert len({body["response_id"] for _, body in answers}) == CONCURRENT
    assert len(await node_ids(proxy.app[keys.STORE], session.session_id)) == CONCURRENT + 1


@pytest.mark.parametrize("key", ["", "k" * 256, "tab\tbed", b"caf\xc3\xa9", b"k\xe9"])
async def test_a_malformed_key_is_400(proxy: ProxyHarness, key):
    session = await proxy.create_session(USER)
    before = await store_snapshot(proxy.app[keys.STORE])
    status, body = await append(proxy, session, TOOL_RESULT, key=key)
    assert status == 400 and body["error"]["param"] == "Idempotency-Key"
    assert await store_snapshot(proxy.app[keys.STORE]) == before
