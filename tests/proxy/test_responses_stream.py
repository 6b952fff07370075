"""The Responses API with ``stream: true``, through the official SDK's ``responses.stream`` and
``responses.create(stream=True)``: the events it consumes, the same record as without streaming,
and a coding agent's multi-turn loop over ``previous_response_id`` with function tools."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from tests.harness import ProxyHarness, store_snapshot
from tests.proxy.test_chat_stream import node_fields, stored

SAMPLE = [{"role": "user", "content": "Fix the failing test in tests/test_math.py."}]
READ_FILE = {
    "type": "function",
    "name": "read_file",
    "description": "Read a file of the repository",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}
APPLY_PATCH = {
    "type": "function",
    "name": "apply_patch",
    "description": "Apply a unified diff",
    "parameters": {"type": "object", "properties": {"diff": {"type": "string"}}, "required": ["diff"]},
}
TOOLS = [READ_FILE, APPLY_PATCH]
REPLIES = [
    "<think>First read the test.</think>\n"
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "tests/test_math.py"}}\n</tool_call>',
    "<think>The expected value is wrong; also read the code.</think>\nThe test expects 5. "
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/math.py"}}\n</tool_call>',
    '<think>add() subtracts.</think>\n<tool_call>\n{"name": "apply_patch", "arguments": '
    '{"diff": "-    return a - b\\n+    return a + b"}}\n</tool_call>',
    "<think>Done.</think>\nFixed: `add` now adds. The test passes.",
]
TEXT_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def comparable(output: list[Any]) -> list[dict[str, Any]]:
    """Output items without the ids that differ between two responses (item ids, call ids)."""
    items = []
    for item in output:
        data = item.model_dump(exclude_none=True)
        data.pop("id", None)
        data.pop("call_id", None)
        items.append(data)
    return items


async def test_streamed_response_records_exactly_what_a_plain_response_records(proxy: ProxyHarness, store: Any):
    fake = proxy.fake
    session = await proxy.create_session(SAMPLE)
    client = session.client
    for reply in REPLIES[:2]:
        fake.queue(reply, reply)
        plain = await client.responses.create(model="policy", input=SAMPLE, tools=TOOLS)
        kinds = []
        async with client.responses.stream(model="policy", input=SAMPLE, tools=TOOLS) as stream:
            async for event in stream:
                kinds.append(event.type)
            final = await stream.get_final_response()
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.done" in kinds
        assert final.id != plain.id
        assert comparable(final.output) == comparable(plain.output)
        assert final.usage == plain.usage and final.status == plain.status
        assert final.model_extra["token_ids"] == plain.model_extra["token_ids"]
        assert final.model_extra["prompt_token_ids"] == plain.model_extra["prompt_token_ids"]
        assert node_fields(await stored(store, session.session_id, final.id)) == node_fields(
            await stored(store, session.session_id, plain.id)
        )
        # what the stream completed with is what GET /v1/responses/{id} answers
        retrieved = await client.responses.retrieve(final.id)
        # (the SDK adds ``parsed``/``parsed_arguments``: None, to what it parsed from a stream)
        dump = [item.model_dump(exclude_none=True) for item in final.output]
        assert [item.model_dump(exclude_none=True) for item in retrieved.output] == dump
        assert retrieved.usage == final.usage and retrieved.model_extra == final.model_extra


async def test_coding_agent_loop_streams_every_turn(proxy: ProxyHarness):
    """As Codex drives it: every request streamed, each turn's function outputs sent with previous_response_id."""
    fake = proxy.fake
    fake.queue(*REPLIES)
    session = await proxy.create_session(SAMPLE)
    client = session.client
    results = {"read_file": "def test_add():\n    assert add(2, 3) == 5\n", "apply_patch": "applied"}
    previous, inputs, turns = None, list(SAMPLE), []
    for _ in range(len(REPLIES)):
        kinds: list[str] = []
        text = ""
        async with client.responses.stream(
            model="policy", input=inputs, tools=TOOLS, previous_response_id=previous
        ) as stream:
            async for event in stream:
                kinds.append(event.type)
                if event.type == "response.output_text.delta":
                    text += event.delta
            response = await stream.get_final_response()
        turns.append(response)
        numbers = [event for event in kinds if event != "response.output_text.delta"]
        assert numbers[0] == "response.created" and numbers[-1] == "response.completed"
        calls = [item for item in response.output if item.type == "function_call"]
        messages = [item for item in response.output if item.type == "message"]
        assert text == "".join(message.content[0].text for message in messages)
        if not calls:
            break
        inputs = [
            {"type": "function_call_output", "call_id": call.call_id, "output": results[call.name]} for call in calls
        ]
        previous = response.id
    assert len(turns) == 4
    assert [item.name for turn in turns for item in turn.output if item.type == "function_call"] == [
        "read_file",
        "read_file",
        "apply_patch",
    ]
    patch = next(item for item in turns[2].output if item.type == "function_call")
    assert json.loads(patch.arguments) == {"diff": "-    return a - b\n+    return a + b"}
    assert turns[-1].output_text == "Fixed: `add` now adds. The test passes."
    # token-exact: each turn's prompt starts with the previous turn's prompt and output, as the engine saw them
    prompts = fake.prompts
    for turn in range(1, 4):
        previous_tokens = prompts[turn - 1] + turns[turn - 1].model_extra["token_ids"]
        assert prompts[turn][: len(previous_tokens)] == previous_tokens
    trajectory = await proxy.trajectory(turns[-1].id)
    assert trajectory["total_token_ids"] == prompts[-1] + turns[-1].model_extra["token_ids"]


async def test_sync_create_stream_true_yields_the_sequence_numbers_in_order(proxy: ProxyHarness):
    proxy.fake.queue(REPLIES[3])
    session = await proxy.create_session(SAMPLE)

    def stream_sync() -> list[Any]:
        with openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as client:
            return list(client.responses.create(model="policy", input=SAMPLE, stream=True))

    events = await asyncio.to_thread(stream_sync)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events if not event.type.endswith("_text.delta")]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # the reasoning item
        "response.reasoning_text.done",
        "response.output_item.done",
        *[kind for kind in TEXT_EVENTS if kind != "response.output_text.delta"],
        "response.completed",
    ]
    assert "response.reasoning_text.delta" in [event.type for event in events]
    completed = events[-1].response
    assert completed.output_text == "Fixed: `add` now adds. The test passes."


async def test_a_stream_refused_before_its_first_event_is_an_ordinary_error(proxy: ProxyHarness, store: Any):
    session = await proxy.create_session(SAMPLE)
    before = await store_snapshot(store)
    with pytest.raises(openai.NotFoundError) as raised:
        await session.client.responses.create(
            model="policy", input="next", previous_response_id=session.session_id.replace("sess_", "resp_"), stream=True
        )
    assert raised.value.body["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError) as refused:
        await session.client.responses.create(model="policy", input="hi", temperature=0.3, stream=True)
    assert refused.value.body["param"] == "temperature"
    assert await store_snapshot(store) == before
