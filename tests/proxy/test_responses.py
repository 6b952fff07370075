"""The Responses API with the official SDK: token-exact previous_response_id branching."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest

from rollout_proxy.proxy import keys
from tests.harness import ProxyHarness, store_snapshot

SAMPLE = [{"role": "user", "content": "Recite the Three Character Classic, one line at a time."}]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def output_ids(response) -> list[int]:
    return response.model_extra["token_ids"]


def prompt_ids(response) -> list[int]:
    return response.model_extra["prompt_token_ids"]


async def finish(proxy: ProxyHarness, session, ids, **body):
    return await proxy.request(
        "POST", f"/v1/sessions/{session.session_id}/finish", json={"responses": [{"id": i} for i in ids], **body}
    )


async def test_seed_group_rollout_shares_one_stored_prefix(proxy: ProxyHarness):
    """The seed's example: three responses, two of them children of the first."""
    proxy.fake.queue("三字经开篇。", "习相远。", "性乃迁。")
    session = await proxy.create_session(SAMPLE, n_sample=3)
    client = session.client
    response_1 = await client.responses.create(model="m", input=[{"role": "user", "content": "人之初"}])
    response_2 = await client.responses.create(
        model="m", input=[{"role": "user", "content": "性相近"}], previous_response_id=response_1.id
    )
    response_3 = await client.responses.create(
        model="m", input=[{"role": "user", "content": "苟不教"}], previous_response_id=response_1.id
    )
    assert response_1.output_text == "三字经开篇。" and response_2.previous_response_id == response_1.id
    status, body = await finish(proxy, session, [response_1.id, response_2.id, response_3.id])
    assert status == 200, body
    first, second, third = (t["total_token_ids"] for t in body["trajectories"])
    assert second[: len(first)] == first and third[: len(first)] == first
    assert second[len(first) :] != third[len(first) :]
    # the engine saw exactly the parent's tokens before each child's new input
    parent = prompt_ids(response_1) + output_ids(response_1)
    assert prompt_ids(response_2)[: len(parent)] == parent == prompt_ids(response_3)[: len(parent)]
    # stored once: the three nodes together hold exactly the distinct tokens
    store = proxy.app[keys.STORE]
    nodes = [(await store.get_path(session.session_id, r.id))[-1] for r in (response_1, response_2, response_3)]
    assert sum(len(node.prompt_ids) + len(node.output_ids) for node in nodes) == len(first) + (
        len(second) - len(first)
    ) + (len(third) - len(first))
    assert nodes[1].parent_id == nodes[2].parent_id == response_1.id
    # the sample's messages come first, then each branch's inputs
    messages = body["trajectories"][2]["messages"]
    assert [m["content"] for m in messages if m["role"] == "user"] == [SAMPLE[0]["content"], "人之初", "苟不教"]


async def test_fork_from_a_mid_conversation_node(proxy: ProxyHarness):
    session = await proxy.create_session(SAMPLE)
    client = session.client
    chain = [await client.responses.create(model="m", input="one")]
    for word in ("two", "three"):
        chain.append(await client.responses.create(model="m", input=word, previous_response_id=chain[-1].id))
    fork = await client.responses.create(model="m", input="two, again", previous_response_id=chain[1].id)
    middle = prompt_ids(chain[1]) + output_ids(chain[1])
    assert prompt_ids(fork)[: len(middle)] == middle
    trajectory = await proxy.trajectory(fork.id)
    assert trajectory["total_token_ids"] == prompt_ids(fork) + output_ids(fork)
    assert trajectory["turns"] == 3
    long_branch = await proxy.trajectory(chain[2].id)
    assert long_branch["total_token_ids"][: len(middle)] == middle


@pytest.mark.parametrize("echo_previous_output", [False, True])
async def test_tool_call_round_trip(proxy: ProxyHarness, template_name: str, echo_previous_output: bool):
    proxy.fake.queue(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "It is sunny in Paris.",
    )
    session = await proxy.create_session([{"role": "user", "content": "Weather in Paris?"}])
    client = session.client
    first = await client.responses.create(model="m", input=[], tools=[WEATHER])
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert first.model_extra["finish_reason"] == "tool_calls"
    new_input = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}]
    if echo_previous_output:  # some clients send the previous output items back as well
        new_input = [item.model_dump(exclude_none=True) for item in first.output] + new_input
    second = await client.responses.create(model="m", input=new_input, previous_response_id=first.id, tools=[WEATHER])
    assert second.output_text == "It is sunny in Paris."
    previous = prompt_ids(first) + output_ids(first)
    bridge = proxy.fake.decode(prompt_ids(second)[len(previous) :])
    expected = {
        "qwen3_style": "\n<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        "smollm2_default": "\n<|im_start|>tool\nsunny, 21C<|im_end|>\n<|im_start|>assistant\n",
    }[template_name]
    assert prompt_ids(second)[: len(previous)] == previous and bridge == expected


async def test_injected_external_turn_has_weight_zero(proxy: ProxyHarness):
    proxy.fake.queue("人之初，性本善。", "子不教，父之过。教之道，贵以专。")
    session = await proxy.create_session(SAMPLE)
    first = await session.client.responses.create(model="m", input="Begin.")
    status, body = await proxy.request(
        "POST",
        f"/v1/sessions/{session.session_id}/messages",
        json={
            "messages": [{"role": "user", "content": "苟不教"}, {"role": "assistant", "content": "性乃迁"}],
            "previous_response_id": first.id,
        },
        token=session.api_key,
    )
    assert status == 201, body
    injected = body["response_id"]
    injected_trajectory = await proxy.trajectory(injected)
    base = prompt_ids(first) + output_ids(first)
    assert injected_trajectory["total_token_ids"][: len(base)] == base
    added = injected_trajectory["total_token_ids"][len(base) :]
    assert "性乃迁" in proxy.fake.decode(added)
    assert injected_trajectory["total_loss_weight"][len(base) :] == [0.0] * len(added)
    assert injected_trajectory["turns"] == 1
    # the injected node can be extended like any response
    follow = await session.client.responses.create(model="m", input="Continue.", previous_response_id=injected)
    assert prompt_ids(follow)[: len(injected_trajectory["total_token_ids"])] == injected_trajectory["total_token_ids"]
    trajectory = await proxy.trajectory(follow.id)
    weights = np.asarray(trajectory["total_loss_weight"])
    assert weights.sum() == len(output_ids(first)) + len(output_ids(follow))


async def test_get_returns_the_stored_response(proxy: ProxyHarness):
    session = await proxy.create_session(SAMPLE)
    created = await session.client.responses.create(model="m", input="Hello")
    fetched = await session.client.responses.retrieve(created.id)
    assert fetched.model_dump(exclude={"model"}) == created.model_dump(exclude={"model"})
    hidden = await session.client.responses.create(model="m", input="Secret", store=False)
    with pytest.raises(openai.NotFoundError):
        await session.client.responses.retrieve(hidden.id)
    assert (await proxy.trajectory(hidden.id))["turns"] == 1  # the trajectory is still recorded


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": 0.2}, "temperature"),
        ({"top_p": 0.5}, "top_p"),
        ({"max_output_tokens": 20}, "max_output_tokens"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"extra_body": {"top_k": 3}}, "top_k"),
    ],
)
async def test_generation_parameters_are_refused(proxy: ProxyHarness, kwargs, param):
    session = await proxy.create_session(SAMPLE)
    with pytest.raises(openai.BadRequestError) as raised:
        await session.client.responses.create(model="m", input="Hi", **kwargs)
    assert raised.value.body["param"] == param


async def test_unknown_or_foreign_previous_response_is_404(proxy: ProxyHarness):
    mine = await proxy.create_session(SAMPLE)
    other = await proxy.create_session(SAMPLE)
    foreign = await other.client.responses.create(model="m", input="Hi")
    before = await store_snapshot(proxy.app[keys.STORE])
    for previous in (foreign.id, "resp_" + "0" * 32, "nonsense"):
        with pytest.raises(openai.NotFoundError):
            await mine.client.responses.create(model="m", input="Hi", previous_response_id=previous)
    with pytest.raises(openai.NotFoundError):
        await mine.client.responses.retrieve(foreign.id)
    assert await store_snapshot(proxy.app[keys.STORE]) == before


async def test_finish_with_a_wrong_count_is_400_and_emits_nothing(proxy: ProxyHarness):
    session = await proxy.create_session(SAMPLE, n_sample=3)
    one = await session.client.responses.create(model="m", input="a")
    two = await session.client.responses.create(model="m", input="b", previous_response_id=one.id)
    before = await store_snapshot(proxy.app[keys.STORE])
    status, body = await finish(proxy, session, [one.id, two.id])
    assert status == 400 and body["error"]["param"] == "responses" and "n_sample=3" in body["error"]["message"]
    status, body = await finish(proxy, session, [one.id, two.id, "resp_" + "1" * 32])
    assert status == 400 and body["error"]["param"] == "responses[2].id"
    status, body = await finish(proxy, session, [one.id, two.id, two.id])
    assert status == 400
    assert await store_snapshot(proxy.app[keys.STORE]) == before
    three = await session.client.responses.create(model="m", input="c", previous_response_id=one.id)
    status, body = await proxy.request(
        "POST",
        f"/v1/sessions/{session.session_id}/finish",
        json={
            "extra": {"k": 1},
            "responses": [{"id": one.id}, {"id": two.id}, {"id": three.id, "extra": {"reward": 1.0}}],
        },
    )
    assert status == 200 and len(body["trajectories"]) == 3
    assert body["trajectories"][2]["extra"] == {"k": 1, "reward": 1.0}
    assert body["trajectories"][0]["extra"] == {"k": 1}
    status, body = await finish(proxy, session, [one.id, two.id, three.id])
    assert status == 409
    with pytest.raises(openai.APIStatusError) as raised:
        await session.client.responses.create(model="m", input="late")
    assert raised.value.status_code == 409


async def test_single_rollout_finish_emits_the_latest_response(proxy: ProxyHarness):
    session = await proxy.create_session(SAMPLE)
    await session.client.responses.create(model="m", input="a")
    last = await session.client.chat.completions.create(model="m", messages=SAMPLE)
    status, body = await proxy.request(
        "POST",
        f"/v1/sessions/{session.session_id}/finish",
        json={"status": "success", "extra": {"x": 2}},
        token=session.api_key,
    )
    assert status == 200
    assert [t["response_id"] for t in body["trajectories"]] == [last.id]
    assert (await proxy.trajectory(last.id))["extra"] == {"x": 2}


async def test_failed_rollout_finishes_without_trajectories(proxy: ProxyHarness):
    session = await proxy.create_session(SAMPLE, n_sample=2)
    status, body = await proxy.request(
        "POST", f"/v1/sessions/{session.session_id}/finish", json={"status": "failure", "error": "tool server down"}
    )
    assert status == 200 and body["trajectories"] == [] and body["error"] == "tool server down"


async def test_input_that_repeats_the_sample_is_not_duplicated(proxy: ProxyHarness):
    session = await proxy.create_session(SAMPLE)
    repeated = await session.client.responses.create(model="m", input=SAMPLE)
    plain = await session.client.responses.create(model="m", input=[])
    assert prompt_ids(repeated) == prompt_ids(plain)
    assert proxy.fake.decode(prompt_ids(plain)).count(SAMPLE[0]["content"]) == 1


async def test_instructions_are_fixed_for_a_conversation_tree(proxy: ProxyHarness):
    session = await proxy.create_session(SAMPLE)
    first = await session.client.responses.create(model="m", input="Hi", instructions="Answer in French.")
    assert "Answer in French." in proxy.fake.decode(prompt_ids(first))
    same = await session.client.responses.create(
        model="m", input="Again", instructions="Answer in French.", previous_response_id=first.id
    )
    assert same.instructions == "Answer in French."
    with pytest.raises(openai.BadRequestError) as raised:
        await session.client.responses.create(
            model="m", input="x", instructions="Answer in German.", previous_response_id=first.id
        )
    assert raised.value.body["param"] == "instructions"


async def test_responses_tree_survives_a_restart(fake_engine, redis_url):
    async with ProxyHarness.running(engine_urls=[fake_engine.url], store_url=redis_url) as before_restart:
        session = await before_restart.create_session(SAMPLE)
        first = await session.client.responses.create(model="m", input="one")
    async with ProxyHarness.running(engine_urls=[fake_engine.url], store_url=redis_url) as after_restart:
        client = after_restart.client(after_restart.url + "/v1", session.api_key)
        second = await client.responses.create(model="m", input="two", previous_response_id=first.id)
        previous = prompt_ids(first) + output_ids(first)
        assert prompt_ids(second)[: len(previous)] == previous
        assert (await client.responses.retrieve(first.id)).output_text == first.output_text
