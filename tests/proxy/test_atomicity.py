"""Nothing half-written: a request answered with an error changed nothing.

A finish is serialized before it is committed, so an answer that cannot be built
leaves the session open; a turn that finishes after its session did is refused (409)
by the store, atomically with the write, and leaves no node behind.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from rollout_proxy.core.trajectory import AssembledTrajectory
from rollout_proxy.proxy import keys
from tests.harness import ProxyHarness, store_snapshot

USER = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture
def template_name() -> str:
    return "qwen3_style"  # the template plays no part here: one is enough


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"d": value}
    return value


async def session_with_a_turn(proxy: ProxyHarness):
    session = await proxy.create_session(USER)
    reply = await session.client.chat.completions.create(model="m", messages=USER)
    return session, reply.id


async def finish(proxy: ProxyHarness, session_id: str, **body):
    return await proxy.request("POST", f"/v1/sessions/{session_id}/finish", json=body)


async def status_of(proxy: ProxyHarness, session_id: str) -> str:
    status, body = await proxy.request("GET", f"/v1/sessions/{session_id}")
    assert status == 200, body
    return body["status"]


async def test_a_finish_whose_answer_cannot_be_built_leaves_the_session_open(proxy: ProxyHarness, monkeypatch):
    session, response_id = await session_with_a_turn(proxy)

    def unserializable(self):
        raise TypeError("the answer cannot be serialized")

    with monkeypatch.context() as patch:
        patch.setattr(AssembledTrajectory, "to_json", unserializable)
        status, _ = await finish(proxy, session.session_id, status="success", responses=[{"id": response_id}])
    assert status == 500
    assert await status_of(proxy, session.session_id) == "open"
    status, body = await finish(proxy, session.session_id, status="success", responses=[{"id": response_id}])
    assert status == 200, body
    assert [t["response_id"] for t in body["trajectories"]] == [response_id]


@pytest.mark.parametrize("where", ["extra", "response extra"])
async def test_a_finish_with_a_300_deep_extra_is_refused_and_leaves_the_session_open(proxy: ProxyHarness, where):
    """The probe's case: the rollout's (or one response's) ``extra`` too deep to serialize."""
    session, response_id = await session_with_a_turn(proxy)
    deep = nested(300)
    body = (
        {"status": "success", "extra": deep, "responses": [{"id": response_id}]}
        if where == "extra"
        else {"status": "success", "responses": [{"id": response_id, "extra": deep}]}
    )
    status, _ = await finish(proxy, session.session_id, **body)
    assert status >= 400
    assert await status_of(proxy, session.session_id) == "open"
    status, answer = await finish(proxy, session.session_id, status="success", responses=[{"id": response_id}])
    assert status == 200, answer


async def test_a_result_the_store_cannot_encode_is_400_and_changes_nothing(proxy: ProxyHarness):
    """No trajectory to serialize: the store itself refuses, on both stores alike."""
    session = await proxy.create_session(USER)
    before = await store_snapshot(proxy.app[keys.STORE])
    status, body = await finish(proxy, session.session_id, status="failure", extra=nested(300))
    assert status == 400, body
    assert await store_snapshot(proxy.app[keys.STORE]) == before
    assert await status_of(proxy, session.session_id) == "open"


async def test_a_turn_in_flight_when_its_session_finishes_is_409_and_not_written(proxy: ProxyHarness):
    assert proxy.fake is not None
    session, first_id = await session_with_a_turn(proxy)
    proxy.fake.delay = 0.5
    history = [*USER, {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    late = asyncio.create_task(session.client.chat.completions.create(model="m", messages=history))
    for _ in range(200):  # until the turn has reached the engine
        if proxy.fake.inflight:
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the turn never reached the engine")
    status, finished = await finish(proxy, session.session_id, status="success")
    assert status == 200, finished
    assert [t["response_id"] for t in finished["trajectories"]] == [first_id]
    after_finish = await store_snapshot(proxy.app[keys.STORE])
    with pytest.raises(openai.ConflictError) as refused:
        await late
    assert refused.value.code == "session_finished"
    assert await store_snapshot(proxy.app[keys.STORE]) == after_finish
    status, trajectory = await proxy.request("GET", f"/v1/sessions/{session.session_id}/trajectory")
    assert status == 200 and trajectory["response_id"] == first_id


async def test_messages_appended_while_the_session_finishes_are_409_and_not_written(proxy: ProxyHarness, monkeypatch):
    """The same race through ``POST /messages``: the write is refused, not only the first check."""
    session, first_id = await session_with_a_turn(proxy)
    store = proxy.app[keys.STORE]
    original = store.put_node
    finished = []

    async def finish_first(*args, **kwargs):  # the finish lands between the open check and the write
        status, _ = await finish(proxy, session.session_id, status="success")
        assert status == 200
        finished.append(await store_snapshot(store))
        return await original(*args, **kwargs)

    monkeypatch.setattr(store, "put_node", finish_first)
    status, body = await proxy.request(
        "POST",
        f"/v1/sessions/{session.session_id}/messages",
        json={"messages": [{"role": "user", "content": "late"}], "previous_response_id": first_id},
        token=session.api_key,
    )
    assert status == 409 and body["error"]["code"] == "session_finished"
    assert await store_snapshot(store) == finished[0]
