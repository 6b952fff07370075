"""Streaming through the proxy against a real vLLM: zero drift against vLLM's own streamed ids.

A relay between the proxy and vLLM forwards the SSE stream as it comes and keeps it, so the
checks compare what the proxy recorded (and what its client saw) with the chunks vLLM itself sent.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests.harness import WEATHER_TOOL, ProxyHarness
from tests.integration.conftest import RecordingRelay, TokenAudit, VLLMServers

SYSTEM = "You are a weather assistant. Call get_weather when you need the weather."


@dataclass
class StreamRecorder(RecordingRelay):
    """The recording relay, also for ``stream: true`` calls (``/v1/completions``, and ``/inference/v1/generate``
    for prompts with images): forwarded chunk by chunk, kept parsed."""

    streams: list[tuple[dict[str, Any], list[dict[str, Any]]]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:  # type: ignore[override]
        body = await request.read()
        payload = orjson.loads(body) if body else None
        streamed = request.path in ("/v1/completions", "/inference/v1/generate")
        if not streamed or not (isinstance(payload, dict) and payload.get("stream")):
            return await super().handle(request)
        raw = bytearray()
        async with (
            aiohttp.ClientSession() as http,
            http.post(self.target + request.path_qs, data=body, headers={"Content-Type": "application/json"}) as answer,
        ):
            response = web.StreamResponse(
                status=answer.status, headers={"Content-Type": answer.headers["Content-Type"]}
            )
            await response.prepare(request)
            async for data in answer.content.iter_any():
                raw += data
                await response.write(data)
        events = bytes(raw).decode().split("\n\n")
        self.streams.append((payload, [orjson.loads(e[6:]) for e in events if e.startswith("data: {")]))
        await response.write_eof()
        return response


@pytest.fixture
async def recorder(vllm_servers: VLLMServers) -> AsyncIterator[StreamRecorder]:
    async with StreamRecorder.serving(vllm_servers.get("qwen3_style").base_url) as relay:
        yield relay  # type: ignore[misc]


def engine_turns(recorder: StreamRecorder) -> list[tuple[list[int], list[int], list[float]]]:
    """vLLM's (prompt, output, logprobs) per streamed call, from its own chunks."""
    turns = []
    for request, chunks in recorder.streams:
        choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
        assert choices[0]["prompt_token_ids"] == request["prompt"]  # vLLM consumed exactly what we sent
        assert choices[-1]["finish_reason"] in ("stop", "length")
        output = [token for choice in choices for token in choice["token_ids"]]
        logprobs = [value for choice in choices for value in (choice["logprobs"] or {}).get("token_logprobs", [])]
        turns.append((request["prompt"], output, logprobs))
    return turns


async def test_streamed_chat_turns_have_zero_drift(recorder: StreamRecorder, audit: TokenAudit):
    async with ProxyHarness.running(engine_urls=[recorder.url]) as proxy:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris?"}]
        session = await proxy.create_session(messages, tools=[WEATHER_TOOL], max_new_tokens=48)
        client = session.client
        first = await client.chat.completions.create(model="m", messages=messages)  # the engine: no routing
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        seen: list[list[int]] = []
        last_id = first.id
        for question in ("And in Rome?", "Thanks. Which is warmer?"):
            messages.append({"role": "user", "content": question})
            stream = await client.chat.completions.create(model="m", messages=messages, stream=True)
            chunks = [chunk async for chunk in stream]
            seen.append([t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])])
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            last_id = chunks[0].id
            messages.append({"role": "assistant", "content": content})
        turns = engine_turns(recorder)
        assert len(turns) == 2
        for (_, output, _), client_ids in zip(turns, seen, strict=True):
            audit.compare(client_ids, output)
            assert client_ids == output  # what the client saw is what vLLM sampled
        first_prompt = recorder.completions[0][1]["choices"][0]["prompt_token_ids"]
        first_output = recorder.completions[0][1]["choices"][0]["token_ids"]
        chain = [(first_prompt, first_output), *((prompt, output) for prompt, output, _ in turns)]
        for (prompt, output), (next_prompt, _) in itertools.pairwise(chain):
            audit.compare(next_prompt[: len(prompt) + len(output)], prompt + output)
            assert next_prompt[: len(prompt) + len(output)] == prompt + output  # zero drift
        trajectory = await proxy.trajectory(last_id)
        prompt, output, logprobs = turns[-1]
        audit.compare(trajectory["total_token_ids"], prompt + output)
        assert trajectory["total_token_ids"] == prompt + output
        assert trajectory["total_token_logprobs"][len(prompt) :] == logprobs  # vLLM's values, exactly
