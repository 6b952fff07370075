"""A group's samples that reach the same visible answer by different reasoning stay apart.

Content leaves the reasoning and the proxy's tool-call ids out, so two such answers share one path. Each
sample's next turn must continue the node its client was answered, told by what the client echoes (the
tool-call ids, the reasoning, a reasoning echoed of an earlier turn), over Chat Completions, the Responses
API without ``previous_response_id`` and the Messages API; where nothing echoed tells, the proxy says so
(counted, recorded on the node) and never trains one node twice while another is left without its turn.
Runs over both stores and both chat templates.
"""

from __future__ import annotations

from typing import Any

import anthropic
import numpy as np

from rollout_proxy.proxy import keys
from tests.harness import WEATHER_TOOL, ProxyHarness

TASK = [{"role": "user", "content": "Pick a city for the trip."}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def thought(text: str, answer: str) -> str:
    return f"<think>\n{text}\n</think>\n\n{answer}"


async def parent_of(proxy: ProxyHarness, session_id: str, response_id: str) -> Any:
    path = await proxy.app[keys.STORE].get_path(session_id, response_id)
    assert path is not None and len(path) >= 2
    return path[-2]


def metric(proxy: ProxyHarness, name: str, **labels: str) -> float:
    return proxy.app[keys.METRICS].value(name, **labels)


async def trained_once(proxy: ProxyHarness, session_id: str) -> None:
    """The session's export trains every sampled token in exactly one sequence (a group keeps its retries)."""
    status, export = await proxy.request("GET", f"/v1/sessions/{session_id}/rollout")
    assert status == 200, export
    assert export["trained_tokens"] == export["sampled_tokens"] and export["dropped_tokens"] == 0
    nodes = await proxy.app[keys.STORE].get_nodes(session_id)
    assert nodes is not None
    assert export["sampled_tokens"] == sum(len(node.output_ids) for node in nodes)
    assert (
        sum(float(np.sum(sequence["total_loss_weight"])) for sequence in export["sequences"])
        == (export["trained_tokens"])
    )


async def first_answers(proxy: ProxyHarness, session: Any, replies: list[str], **options: Any) -> list[Any]:
    proxy.fake.queue(*replies)
    return [await session.client.chat.completions.create(model="policy", messages=TASK, **options) for _ in replies]


async def test_chat_tool_calls_name_their_node_without_the_reasoning(proxy: ProxyHarness):
    session = await proxy.create_session(TASK, tools=[WEATHER_TOOL], n_sample=2)
    a, b = await first_answers(proxy, session, [thought("Warm places first.", CALL), thought("Paris, surely.", CALL)])
    assert a.choices[0].message.tool_calls[0].function == b.choices[0].message.tool_calls[0].function
    proxy.fake.queue("Paris it is.", "Paris, then.")
    follows = []
    for first in (a, b):  # the reasoning dropped, as most clients do; the proxy's tool-call ids echoed
        calls = [call.model_dump() for call in first.choices[0].message.tool_calls]
        messages = [
            *TASK,
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18C"},
        ]
        follows.append(await session.client.chat.completions.create(model="policy", messages=messages))
    assert (await parent_of(proxy, session.session_id, follows[0].id)).id == a.id
    assert (await parent_of(proxy, session.session_id, follows[1].id)).id == b.id
    assert metric(proxy, "sibling_parents_total", api="chat", by="tool_call_id") == 2
    assert metric(proxy, "parent_ambiguities_total", api="chat") == 0
    await trained_once(proxy, session.session_id)


async def test_chat_echoed_reasoning_names_its_node(proxy: ProxyHarness):
    session = await proxy.create_session(TASK, n_sample=2)
    a, b = await first_answers(proxy, session, [thought("Warm places first.", "Paris."), thought("Surely.", "Paris.")])
    assert a.choices[0].message.content == b.choices[0].message.content == "Paris."
    proxy.fake.queue("Because of the food.", "Because of the museums.")
    follows = []
    for first in (b, a):  # the later sibling continues first: the newest is not the answer here
        message = first.choices[0].message
        echoed = {"role": "assistant", "content": message.content, "reasoning_content": message.reasoning_content}
        messages = [*TASK, echoed, {"role": "user", "content": "Why?"}]
        follows.append(await session.client.chat.completions.create(model="policy", messages=messages))
    assert (await parent_of(proxy, session.session_id, follows[0].id)).id == b.id
    assert (await parent_of(proxy, session.session_id, follows[1].id)).id == a.id
    assert metric(proxy, "sibling_parents_total", api="chat", by="reasoning") == 2
    await trained_once(proxy, session.session_id)


async def test_chat_reasoning_of_an_earlier_turn_names_the_path(proxy: ProxyHarness):
    """Two turns each with the same visible answer; only the first turn's echoed reasoning differs."""
    session = await proxy.create_session(TASK, n_sample=2)
    a, b = await first_answers(proxy, session, [thought("Warm places first.", "Paris."), thought("Surely.", "Paris.")])
    proxy.fake.queue("The food.", "The food.", "Agreed.", "Agreed.")

    def history(first: Any) -> list[dict[str, Any]]:
        message = first.choices[0].message
        echoed = {"role": "assistant", "content": message.content, "reasoning_content": message.reasoning_content}
        return [*TASK, echoed, {"role": "user", "content": "Why?"}]

    seconds = [
        await session.client.chat.completions.create(model="policy", messages=history(first)) for first in (a, b)
    ]
    thirds = []
    for first, second in zip((a, b), seconds, strict=True):
        said = {"role": "assistant", "content": second.choices[0].message.content}
        messages = [*history(first), said, {"role": "user", "content": "Anything else?"}]
        thirds.append(await session.client.chat.completions.create(model="policy", messages=messages))
    assert (await parent_of(proxy, session.session_id, thirds[0].id)).id == seconds[0].id
    assert (await parent_of(proxy, session.session_id, thirds[1].id)).id == seconds[1].id
    assert metric(proxy, "sibling_parents_total", api="chat", by="history") == 2
    assert metric(proxy, "parent_ambiguities_total", api="chat") == 0
    await trained_once(proxy, session.session_id)


async def test_chat_without_anything_to_tell_is_a_counted_ambiguity(proxy: ProxyHarness):
    """Same answer, reasoning dropped: the proxy cannot know. Each turn takes the newest sibling not yet
    continued, says so on the node and in a metric, and every sampled token is still trained once."""
    session = await proxy.create_session(TASK, n_sample=3)
    replies = [thought("Warm places first.", "Paris."), thought("Surely.", "Paris."), thought("Hmm.", "Paris.")]
    firsts = await first_answers(proxy, session, replies)
    proxy.fake.queue("One.", "Two.", "Three.")
    messages = [*TASK, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Why?"}]
    follows = [await session.client.chat.completions.create(model="policy", messages=messages) for _ in firsts]
    parents = [(await parent_of(proxy, session.session_id, follow.id)).id for follow in follows]
    assert parents == [first.id for first in reversed(firsts)]  # each continued once: newest not continued
    store = proxy.app[keys.STORE]
    for follow in follows:
        node = (await store.get_path(session.session_id, follow.id))[-1]
        assert node.meta["parent_ambiguity"] == {"candidates": 3, "rule": "newest_not_continued"}
    assert metric(proxy, "parent_ambiguities_total", api="chat") == 3
    fourth = await session.client.chat.completions.create(model="policy", messages=messages)  # all continued
    node = (await store.get_path(session.session_id, fourth.id))[-1]
    assert node.meta["parent_ambiguity"] == {"candidates": 3, "rule": "newest"}
    assert node.parent_id == firsts[-1].id
    await trained_once(proxy, session.session_id)


async def test_a_conversation_with_one_node_there_records_no_ambiguity(proxy: ProxyHarness):
    session = await proxy.create_session(TASK, n_sample=2)
    a, b = await first_answers(proxy, session, ["Paris.", "Lyon."])
    proxy.fake.queue("Because.")
    messages = [*TASK, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Why?"}]
    follow = await session.client.chat.completions.create(model="policy", messages=messages)
    node = await parent_of(proxy, session.session_id, follow.id)
    assert node.id == a.id and b.id != a.id
    path = await proxy.app[keys.STORE].get_path(session.session_id, follow.id)
    assert "parent_ambiguity" not in path[-1].meta
    assert metric(proxy, "parent_ambiguities_total", api="chat") == 0


async def test_responses_without_previous_response_id_keep_siblings_apart(proxy: ProxyHarness):
    """The whole input resent: the reasoning item dropped, the function call's call_id the proxy's."""
    session = await proxy.create_session(TASK, tools=[WEATHER_TOOL], n_sample=2)
    proxy.fake.queue(thought("Warm places first.", CALL), thought("Paris, surely.", CALL), "Paris.", "Paris!")
    tools = [{"type": "function", **WEATHER_TOOL["function"]}]
    firsts = [await session.client.responses.create(model="policy", input=TASK, tools=tools) for _ in range(2)]
    follows = []
    for first in firsts:
        items = [item.model_dump(exclude_none=True) for item in first.output if item.type == "function_call"]
        output = {"type": "function_call_output", "call_id": items[0]["call_id"], "output": "18C"}
        follows.append(
            await session.client.responses.create(model="policy", input=[*TASK, *items, output], tools=tools)
        )
    for first, follow in zip(firsts, follows, strict=True):
        assert (await parent_of(proxy, session.session_id, follow.id)).id == first.id
    assert metric(proxy, "sibling_parents_total", api="responses", by="tool_call_id") == 2
    await trained_once(proxy, session.session_id)


async def test_messages_tool_use_ids_name_their_node_without_the_thinking(proxy: ProxyHarness):
    session = await proxy.create_session(TASK, n_sample=2)
    proxy.fake.queue(thought("Warm places first.", CALL), thought("Paris, surely.", CALL), "Paris.", "Paris!")
    tool = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key=session.api_key, max_retries=0) as sdk:
        firsts = [
            await sdk.messages.create(model="policy", max_tokens=256, messages=TASK, tools=[tool]) for _ in range(2)
        ]
        follows = []
        for first in firsts:
            use = next(block for block in first.content if block.type == "tool_use")
            messages = [
                *TASK,
                {"role": "assistant", "content": [use.model_dump()]},  # the thinking block dropped
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18C"}]},
            ]
            follows.append(await sdk.messages.create(model="policy", max_tokens=256, messages=messages, tools=[tool]))
    for first, follow in zip(firsts, follows, strict=True):
        assert (await parent_of(proxy, session.session_id, follow.id)).id == first.id
    assert metric(proxy, "sibling_parents_total", api="messages", by="tool_call_id") == 2
    await trained_once(proxy, session.session_id)
