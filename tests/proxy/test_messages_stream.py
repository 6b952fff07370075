"""Messages with ``stream: true`` through the anthropic SDK: Anthropic's event sequence, relayed as the engine
samples, recording exactly what the non-streamed turn records.

The same scripted output is asked for once with ``messages.create`` and once streamed, in the same session
(siblings under the same parent): the stored nodes must be identical but for their ids and times, and the
message the SDK assembles from the events must be the non-streamed message (each thinking signature naming
its own node). A client that leaves mid-stream aborts the engine call and nothing is recorded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anthropic
import pytest

from rollout_proxy.proxy import keys
from rollout_proxy.proxy.anthropic_answers import signed_node, signing_key
from tests.harness import ProxyHarness, store_snapshot
from tests.proxy.test_chat_stream import node_fields, stored
from tests.proxy.test_messages import TOOL, client, one_config, sampled

QUESTION = [{"role": "user", "content": "What's the weather in Paris and Berlin?"}]
TOOLS_REPLY = (
    "<think>I need the weather for both cities.</think>\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "C"}}\n</tool_call>'
)
TEXT_REPLY = "<think>Paris is sunny, Berlin is rainy.</think>\nParis is sunny (21C) and Berlin is rainy (12C). ✓"
STORY = " ".join(f"river{n}" for n in range(60))


def without_ids(message: Any) -> list[dict[str, Any]]:
    """The blocks but for what names the node or the parse (signatures, tool-call ids)."""
    blocks = [block.model_dump(exclude_none=True) for block in message.content]
    for block in blocks:
        block.pop("signature", None)
        block.pop("id", None)
    return blocks


async def until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    async with asyncio.timeout(seconds):
        while not condition():  # noqa: ASYNC110 (the engine's handler updates it; polling is simplest)
            await asyncio.sleep(0.01)


async def test_a_streamed_turn_records_exactly_what_a_created_one_records(proxy: ProxyHarness, store: Any):
    fake = proxy.fake
    session = await proxy.create_session(QUESTION)
    key = signing_key(proxy.app[keys.SETTINGS].token_secret)
    async with client(proxy, session.api_key) as sdk:
        for reply, stop_reason in ((TOOLS_REPLY, "tool_use"), (TEXT_REPLY, "end_turn")):
            fake.queue(reply, reply)
            plain = await sdk.messages.create(model="policy", max_tokens=256, messages=QUESTION, tools=[TOOL])
            events = []
            async with sdk.messages.stream(model="policy", max_tokens=256, messages=QUESTION, tools=[TOOL]) as stream:
                async for event in stream:
                    events.append(event)
                streamed = await stream.get_final_message()

            # the client's view: the same blocks, stop reason and usage; the signatures name each its node
            assert streamed.id != plain.id and streamed.id.startswith("resp_")
            assert without_ids(streamed) == without_ids(plain)
            assert streamed.stop_reason == plain.stop_reason == stop_reason
            assert streamed.usage.input_tokens == plain.usage.input_tokens
            assert streamed.usage.output_tokens == plain.usage.output_tokens
            for message in (plain, streamed):
                thinking = message.content[0]
                assert signed_node(key, thinking.signature, thinking.thinking) == message.id
            kinds = [event.type for event in events]
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
            start = next(event for event in events if event.type == "message_start")
            assert start.message.model_extra["prompt_token_ids"] == plain.model_extra["prompt_token_ids"]
            delta = next(event for event in events if event.type == "message_delta")
            assert delta.model_extra["token_ids"] == plain.model_extra["token_ids"]
            assert sum(event.type == "thinking" for event in events) > 1  # relayed piece by piece

            # the record: identical siblings, the streamed call ids the stored ones
            plain_node = await stored(store, session.session_id, plain.id)
            streamed_node = await stored(store, session.session_id, streamed.id)
            assert node_fields(streamed_node) == node_fields(plain_node)
            calls = streamed_node.messages[-1].get("tool_calls") or []
            assert [c["id"] for c in calls] == [b.id for b in streamed.content if b.type == "tool_use"]
            assert fake.completions[-1]["stream"] is True and fake.completions[-2]["stream"] is False
    trajectory = await proxy.trajectory(streamed.id)
    assert trajectory["total_token_ids"] == sampled(fake)[-1].prompt + sampled(fake)[-1].tokens


@one_config
async def test_the_sync_client_streams_the_same_turn_and_raw_events_are_anthropics(proxy: ProxyHarness):
    fake = proxy.fake
    fake.queue(TEXT_REPLY, TEXT_REPLY)
    session = await proxy.create_session(QUESTION)
    async with client(proxy, session.api_key) as sdk:
        plain = await sdk.messages.create(model="policy", max_tokens=256, messages=QUESTION)

    def raw_stream() -> list[Any]:
        with anthropic.Anthropic(base_url=proxy.url, api_key=session.api_key, max_retries=0) as sdk:
            return list(sdk.messages.create(model="policy", max_tokens=256, messages=QUESTION, stream=True))

    events = await asyncio.to_thread(raw_stream)
    kinds = [event.type for event in events]
    # (the SDK swallows ``ping``)
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-2:] == ["message_delta", "message_stop"]
    blocks = [(event.index, event.content_block.type) for event in events if event.type == "content_block_start"]
    assert blocks == [(0, "thinking"), (1, "text")]
    deltas = [event.delta for event in events if event.type == "content_block_delta"]
    assert [d.type for d in deltas if d.type not in ("thinking_delta", "text_delta")] == ["signature_delta"]
    assert "".join(d.text for d in deltas if d.type == "text_delta") == plain.content[1].text
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == plain.content[0].thinking
    assert [event.index for event in events if event.type == "content_block_stop"] == [0, 1]
    assert events[-2].delta.stop_reason == "end_turn"


@one_config
async def test_a_client_that_leaves_mid_stream_aborts_the_engine_call_and_nothing_is_recorded(proxy: ProxyHarness):
    fake = proxy.fake
    fake.delay = 3.0
    fake.queue(STORY)
    for engine in proxy.app[keys.ENGINES].engines:  # known to return no routing: they stream from the first token
        engine.returns_routing = False
    session = await proxy.create_session(QUESTION)
    before = await store_snapshot(proxy.app[keys.STORE])
    async with client(proxy, session.api_key) as sdk:
        stream = await sdk.messages.create(model="policy", max_tokens=256, messages=QUESTION, stream=True)
        texts = 0
        async for event in stream:
            texts += event.type == "content_block_delta"
            if texts == 3:
                break
        await stream.close()  # the client goes away after three pieces of the answer
    await until(lambda: len(fake.disconnects) == 1)
    generation = sampled(fake)[-1]
    await until(lambda: generation.finish_reason is not None)
    assert generation.finish_reason == "abort" and len(generation.tokens) < len(fake.encode(STORY))
    metrics = proxy.app[keys.METRICS]
    await until(lambda: metrics.value("streamed_turns_total", api="messages", outcome="disconnected") == 1)
    assert await store_snapshot(proxy.app[keys.STORE]) == before


@one_config
async def test_an_engine_failure_after_the_first_event_is_an_error_event(proxy: ProxyHarness):
    """The engine resets its connection after the first token it streamed: what the client saw cannot be
    taken back, so the stream ends with Anthropic's ``error`` event (the SDK raises it), nothing recorded."""
    fake = proxy.fake
    fake.queue(STORY)
    for engine in proxy.app[keys.ENGINES].engines:
        engine.returns_routing = False
    session = await proxy.create_session(QUESTION)
    fake.fault = "reset"
    async with client(proxy, session.api_key) as sdk:
        stream = await sdk.messages.create(model="policy", max_tokens=256, messages=QUESTION, stream=True)
        seen = []
        with pytest.raises(anthropic.APIStatusError) as failed:
            async for event in stream:
                seen.append(event.type)
    assert seen[0] == "message_start" and "content_block_delta" in seen
    assert failed.value.body["type"] == "error" and failed.value.body["error"]["type"]
    assert not await proxy.app[keys.STORE].get_nodes(session.session_id)
