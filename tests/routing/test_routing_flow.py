"""Routed experts through the proxy, aligned with every token of the trajectory."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest

from devtools.fake_engine import FakeMoE
from rollout_proxy.proxy import keys
from tests.harness import WEATHER_TOOL, ProxyHarness, store_snapshot

USER = [{"role": "user", "content": "What's the weather in Paris?"}]


async def stored_node(store, session_id: str, response_id: str):
    """The node as stored, with its routing rows."""
    return (await store.get_path(session_id, response_id, routing=True))[-1]


def routing_of(trajectory) -> np.ndarray:
    field = trajectory["routed_experts"]
    assert field["dtype"] == "int16"
    return np.frombuffer(base64.b64decode(field["data"]), dtype=np.int16).reshape(field["shape"])


@pytest.fixture
def moe(proxy: ProxyHarness) -> FakeMoE:
    proxy.fake.moe = FakeMoE(num_layers=3, top_k=2, num_experts=8)
    return proxy.fake.moe


async def test_dense_engine_gives_null_routing(proxy: ProxyHarness):
    session = await proxy.create_session(USER)
    reply = await session.client.chat.completions.create(model="m", messages=USER)
    assert (await proxy.trajectory(reply.id))["routed_experts"] is None
    assert "routed_experts_prompt_start" not in proxy.fake.completions[-1]


async def test_single_turn_has_inputs_plus_decodes_minus_one_rows(proxy: ProxyHarness, moe: FakeMoE):
    session = await proxy.create_session(USER)
    reply = await session.client.chat.completions.create(model="m", messages=USER)
    trajectory = await proxy.trajectory(reply.id)
    routing = routing_of(trajectory)
    ids = trajectory["total_token_ids"]
    assert routing.shape == (len(ids), 3, 2)
    observed = (routing >= 0).all(axis=(1, 2))
    assert observed[:-1].all() and not observed[-1] and (routing[-1] == -1).all()
    assert np.array_equal(routing[:-1], moe.rows(ids[:-1]))


async def test_four_turn_chat_fills_every_interior_boundary(proxy: ProxyHarness, moe: FakeMoE):
    fake = proxy.fake
    fake.queue(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Sunny. Anything else?",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
        "Rome is warm.",
    )
    session = await proxy.create_session(USER, tools=[WEATHER_TOOL])
    messages = list(USER)
    replies = []
    for follow_up in ("tool:sunny", "user:And Rome?", "tool:warm", None):
        reply = await session.client.chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL])
        replies.append(reply)
        messages.append(reply.choices[0].message.model_dump())
        if follow_up is None:
            break
        role, content = follow_up.split(":")
        if role == "tool":
            messages.append(
                {"role": "tool", "tool_call_id": reply.choices[0].message.tool_calls[0].id, "content": content}
            )
        else:
            messages.append({"role": "user", "content": content})
    trajectory = await proxy.trajectory(replies[-1].id)
    ids = trajectory["total_token_ids"]
    routing = routing_of(trajectory)
    # every position but the last was an input of some forward pass, and its row is the real one
    assert np.array_equal(routing[:-1], moe.rows(ids[:-1]))
    assert (routing[-1] == -1).all()
    # each later turn asked only for the rows not held yet: from the previous turn's last token
    for turn in range(1, 4):
        previous = len(fake.prompts[turn - 1]) + len(replies[turn - 1].choices[0].model_extra["token_ids"])
        assert fake.completions[turn]["routed_experts_prompt_start"] == previous - 1
    # stored compactly: each node holds only its own rows, one byte per expert id
    store = proxy.app[keys.STORE]
    nodes = [await stored_node(store, session.session_id, reply.id) for reply in replies]
    assert sum(len(node.routing.valid) for node in nodes) == len(ids) - 1
    assert {node.routing.experts.dtype.str for node in nodes} == {"|u1"}


async def test_group_branches_own_their_boundary_rows(proxy: ProxyHarness, moe: FakeMoE):
    session = await proxy.create_session(USER, n_sample=3)
    parent = await session.client.responses.create(model="m", input=[])
    children = [
        await session.client.responses.create(model="m", input=word, previous_response_id=parent.id)
        for word in ("one", "two", "three")
    ]
    status, body = await proxy.request(
        "POST", f"/v1/sessions/{session.session_id}/finish", json={"responses": [{"id": c.id} for c in children]}
    )
    assert status == 200
    parent_len = len(parent.model_extra["prompt_token_ids"]) + len(parent.model_extra["token_ids"])
    store = proxy.app[keys.STORE]
    parent_node = await stored_node(store, session.session_id, parent.id)
    assert parent_node.routing.stop == parent_len - 1  # the parent never holds its last position
    for child, trajectory in zip(children, body["trajectories"], strict=True):
        node = await stored_node(store, session.session_id, child.id)
        assert node.routing.start == parent_len - 1  # the boundary row lives with the branch
        routing = routing_of(trajectory)
        ids = trajectory["total_token_ids"]
        assert np.array_equal(routing[:-1], moe.rows(ids[:-1])) and (routing[-1] == -1).all()
    # shared rows are stored once
    stored = len(parent_node.routing.valid)
    for child in children:
        stored += len((await stored_node(store, session.session_id, child.id)).routing.valid)
    distinct = parent_len - 1 + sum(len(t["total_token_ids"]) - parent_len for t in body["trajectories"])
    assert stored == distinct


async def test_rows_the_engine_skipped_for_its_cache_stay_unobserved(proxy: ProxyHarness, moe: FakeMoE):
    moe.prefix_cache = True
    long_prompt = [{"role": "user", "content": "Please summarise this. " * 12}]
    first_session = await proxy.create_session(long_prompt)
    await first_session.client.chat.completions.create(model="m", messages=long_prompt)
    second_session = await proxy.create_session(long_prompt)
    reply = await second_session.client.chat.completions.create(model="m", messages=long_prompt)
    trajectory = await proxy.trajectory(reply.id)
    routing = routing_of(trajectory)
    observed = (routing >= 0).all(axis=(1, 2))
    cached = moe.block_size * ((len(reply.model_extra["prompt_token_ids"]) - 1) // moe.block_size)
    assert cached > 0
    assert not observed[:cached].any() and observed[cached:-1].all()
    assert np.array_equal(routing[cached:-1], moe.rows(trajectory["total_token_ids"][:-1])[cached:])


async def test_overlap_disagreement_is_counted_and_flagged(proxy: ProxyHarness, moe: FakeMoE):
    moe.ignore_prompt_start = True
    session = await proxy.create_session(USER)
    first = await session.client.chat.completions.create(model="m", messages=USER)
    moe.faults.append("flip")  # the engine resends row 0 and now disagrees about it
    history = [*USER, first.choices[0].message.model_dump(), {"role": "user", "content": "More?"}]
    second = await session.client.chat.completions.create(model="m", messages=history)
    trajectory = await proxy.trajectory(second.id)
    assert trajectory["routing_disagreements"] == 1
    assert proxy.app[keys.METRICS].value("routing_disagreements_total") == 1
    routing = routing_of(trajectory)
    assert np.array_equal(routing[0], moe.rows(trajectory["total_token_ids"][:1])[0])  # not overwritten


@pytest.mark.parametrize("fault", ["short", "garbage", "float"])
async def test_malformed_engine_routing_fails_the_turn_and_stores_nothing(proxy: ProxyHarness, moe: FakeMoE, fault):
    session = await proxy.create_session(USER)
    before = await store_snapshot(proxy.app[keys.STORE])
    moe.faults.append(fault)
    with pytest.raises(openai.APIStatusError) as raised:
        await session.client.chat.completions.create(model="m", messages=USER)
    assert raised.value.status_code == 502 and "routed experts" in raised.value.body["message"]
    assert await store_snapshot(proxy.app[keys.STORE]) == before
    assert proxy.app[keys.METRICS].value("routing_malformed_total") == 1
