"""Chat Completions with ``stream: true``, through the official openai SDK (async and sync).

The same scripted engine output is asked for once without streaming and once streamed, in the
same session (two siblings under the same parent): the two stored nodes must be identical but for
their ids and times, and the message the client assembles from the chunks must be the
non-streamed message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import numpy as np
import openai

from rollout_proxy.records import ResponseNode
from tests.harness import WEATHER_TOOL, ProxyHarness

QUESTION = [{"role": "user", "content": "What's the weather in Paris and Berlin?"}]
TOOLS_REPLY = (
    "<think>I need the weather for both cities.</think>\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "C"}}\n</tool_call>'
)
TEXT_REPLY = "<think>Paris is sunny, Berlin is rainy.</think>\nParis is sunny (21C) and Berlin is rainy (12C). ✓"


def node_fields(node: ResponseNode) -> dict[str, Any]:
    """Everything a node stores, comparable with ==, but its id, time and tool-call ids (random per parse)."""
    fields = {}
    for item in dataclasses.fields(node):
        value = getattr(node, item.name)
        if item.name in ("id", "created_at", "path_hash"):
            continue
        if isinstance(value, np.ndarray):
            value = (value.dtype.str, value.tobytes())
        fields[item.name] = value
    messages = json.loads(json.dumps(fields["messages"]))
    for message in messages:
        for index, call in enumerate(message.get("tool_calls") or []):
            call["id"] = f"call-{index}"
    fields["messages"] = messages
    return fields


def assemble(chunks: list[Any]) -> dict[str, Any]:
    """The message (and extension fields) a client builds from ``chat.completion.chunk``s."""
    content, reasoning, calls, token_ids = "", "", {}, []
    finish_reason, usage, ids = None, None, set()
    for chunk in chunks:
        ids.add(chunk.id)
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage.model_dump(exclude_none=True)
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = call.id or slot["id"]
                slot["name"] += (call.function.name or "") if call.function else ""
                slot["arguments"] += (call.function.arguments or "") if call.function else ""
            token_ids += (choice.model_extra or {}).get("token_ids") or []
            finish_reason = choice.finish_reason or finish_reason
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(calls.items())
        ]
    if reasoning:
        message["reasoning_content"] = reasoning
    return {"message": message, "token_ids": token_ids, "finish_reason": finish_reason, "usage": usage, "ids": ids}


def plain_message(completion: Any) -> dict[str, Any]:
    message = completion.choices[0].message
    out: dict[str, Any] = {"role": "assistant", "content": message.content or None}
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.model_extra.get("reasoning_content"):
        out["reasoning_content"] = message.model_extra["reasoning_content"]
    return out


async def stored(store: Any, session_id: str, response_id: str) -> ResponseNode:
    path = await store.get_path(session_id, response_id, routing=True)
    assert path
    return path[-1]


async def test_streamed_chat_turn_records_exactly_what_a_plain_turn_records(proxy: ProxyHarness, store: Any):
    fake = proxy.fake
    session = await proxy.create_session(QUESTION, tools=[WEATHER_TOOL])
    client = session.client
    for reply in (TOOLS_REPLY, TEXT_REPLY):
        fake.queue(reply, reply)
        plain = await client.chat.completions.create(model="policy", messages=QUESTION, tools=[WEATHER_TOOL])
        stream = await client.chat.completions.create(
            model="policy",
            messages=QUESTION,
            tools=[WEATHER_TOOL],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        got = assemble(chunks)
        assert len(got["ids"]) == 1
        (streamed_id,) = got["ids"]
        assert streamed_id != plain.id and streamed_id.startswith("resp_")

        # the client's view: the same message, token ids, finish reason and usage as without streaming
        expected = plain_message(plain)
        for call in expected.get("tool_calls", []):
            call["id"] = None
        for call in got["message"].get("tool_calls", []):
            assert call["id"].startswith("call")
            call["id"] = None
        assert got["message"] == expected
        assert got["token_ids"] == plain.choices[0].model_extra["token_ids"]
        assert got["finish_reason"] == plain.choices[0].finish_reason
        assert got["usage"] == plain.usage.model_dump(exclude_none=True)
        assert chunks[0].model_extra["prompt_token_ids"] == plain.model_extra["prompt_token_ids"]

        # the record: identical nodes (siblings under the same parent), and the streamed ids are the stored ones
        plain_node = await stored(store, session.session_id, plain.id)
        streamed_node = await stored(store, session.session_id, streamed_id)
        assert node_fields(streamed_node) == node_fields(plain_node)
        stored_calls = streamed_node.messages[-1].get("tool_calls") or []
        streamed_calls = assemble(chunks)["message"].get("tool_calls") or []
        assert [c["id"] for c in stored_calls] == [c["id"] for c in streamed_calls]
        assert fake.completions[-1]["stream"] is True and fake.completions[-2]["stream"] is False

    trajectory = await proxy.trajectory(streamed_id)
    assert trajectory["total_token_ids"] == fake.prompts[-1] + got["token_ids"]


async def test_sync_client_streams_the_same_turn(proxy: ProxyHarness, store: Any):
    fake = proxy.fake
    fake.queue(TEXT_REPLY, TEXT_REPLY)
    session = await proxy.create_session(QUESTION)
    plain = await session.client.chat.completions.create(model="policy", messages=QUESTION)

    def stream_sync() -> list[Any]:
        with openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as client:
            return list(client.chat.completions.create(model="policy", messages=QUESTION, stream=True))

    chunks = await asyncio.to_thread(stream_sync)
    got = assemble(chunks)
    assert got["message"] == plain_message(plain)
    assert got["usage"] is None  # not asked for
    (streamed_id,) = got["ids"]
    assert node_fields(await stored(store, session.session_id, streamed_id)) == node_fields(
        await stored(store, session.session_id, plain.id)
    )


async def test_sdk_stream_helper_assembles_the_message(proxy: ProxyHarness):
    proxy.fake.queue(TOOLS_REPLY, TOOLS_REPLY)
    session = await proxy.create_session(QUESTION, tools=[WEATHER_TOOL])
    client = session.client
    plain = await client.chat.completions.create(model="policy", messages=QUESTION, tools=[WEATHER_TOOL])
    async with client.chat.completions.stream(model="policy", messages=QUESTION, tools=[WEATHER_TOOL]) as stream:
        final = await stream.get_final_completion()
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls
    ]
    assert message.model_extra["reasoning_content"] == plain.choices[0].message.model_extra["reasoning_content"]
    assert not message.content


async def test_logprobs_stream_with_their_tokens(proxy: ProxyHarness):
    proxy.fake.queue(TEXT_REPLY, TEXT_REPLY)
    session = await proxy.create_session(QUESTION)
    plain = await session.client.chat.completions.create(model="policy", messages=QUESTION, logprobs=True)
    stream = await session.client.chat.completions.create(model="policy", messages=QUESTION, logprobs=True, stream=True)
    streamed = [
        entry
        async for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in plain.choices[0].logprobs.content]
