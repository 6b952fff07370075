"""Streams that stream: content reaches the client as the engine samples it, from the first turn on.

Whether a turn's output starts inside a ``<think>`` block is decided from the prompt the proxy
rendered (its generation prompt), so a plain reply is released from its first token with the default
parsers (hermes, think), and a template that opens ``<think>`` in the prompt streams its reasoning at
once and its answer right after ``</think>``. The first turn on an engine streams too: whether the engine
returns MoE routing (which vLLM does not stream) is asked with a one-token probe before it.

"Before half of it was sampled" is read off the fake engine itself (the tokens its in-flight generation
holds when the client gets its first content), not off a clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.proxy import keys
from tests.conftest import TEMPLATES
from tests.harness import ProxyHarness, store_snapshot
from tests.scenarios.test_stream_faults import until

QUESTION = [{"role": "user", "content": "Tell me a long story about rivers."}]
STORY = " ".join(f"river{n}" for n in range(30))
THOUGHT = "A short thought."
#: the Qwen3-style template whose generation prompt opens a reasoning block, as DeepSeek-R1's and the Qwen3
#: thinking variants do: the output starts inside <think>
OPENED_TEMPLATE = TEMPLATES["qwen3_style"].replace(  # type: ignore[union-attr]
    "{{- '<|im_start|>assistant\\n' -}}", "{{- '<|im_start|>assistant\\n<think>\\n' -}}"
)
CASES = {
    "qwen3_style": (TEMPLATES["qwen3_style"], STORY),
    "smollm2_default": (TEMPLATES["smollm2_default"], STORY),
    "opens_think": (OPENED_TEMPLATE, f"{THOUGHT}</think>\n\n{STORY}"),
}


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def streaming(tokenizer_dir: Path, case: str, tmp_path: Path) -> AsyncIterator[ProxyHarness]:
    """A fresh engine (nothing learned about it yet) taking ~20 ms a token, and a proxy rendering locally."""
    template, _ = CASES[case]
    assert TEMPLATES["qwen3_style"] != OPENED_TEMPLATE  # the replacement took
    engine = FakeEngine(tokenizer_dir, chat_template=template, delay=2.0)
    template_file = ""
    if template is not None:
        path = tmp_path / "template.jinja"
        path.write_text(template)
        template_file = str(path)
    async with (
        FakeEngineServer(engine) as url,
        ProxyHarness.running(engine_urls=[url], fake=engine, chat_template=template_file) as proxy,
    ):
        yield proxy


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    buffer = b""
    async for data in response.content.iter_any():
        buffer += data
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data: {"):
                    yield orjson.loads(line[len(b"data: ") :])


def text_of(api: str, event: dict[str, Any]) -> tuple[str, str]:
    """(reasoning, content) an event adds."""
    if api == "chat":
        delta = (event.get("choices") or [{}])[0].get("delta") or {}
        return delta.get("reasoning_content") or "", delta.get("content") or ""
    kind = event.get("type")
    if kind == "response.reasoning_text.delta":
        return event["delta"], ""
    if kind == "response.output_text.delta":
        return "", event["delta"]
    return "", ""


async def open_stream(proxy: ProxyHarness, http: aiohttp.ClientSession, api: str) -> aiohttp.ClientResponse:
    session = await proxy.create_session(QUESTION, max_new_tokens=400)
    path, body = (
        ("/v1/chat/completions", {"model": "m", "messages": QUESTION, "stream": True})
        if api == "chat"
        else ("/v1/responses", {"model": "m", "input": QUESTION, "stream": True})
    )
    headers = {"Authorization": f"Bearer {session.api_key}"}
    response = await http.post(proxy.url + path, json=body, headers=headers)
    assert response.status == 200, await response.text()
    return response


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_a_plain_reply_streams_before_half_of_it_is_sampled(streaming: ProxyHarness, case: str, api: str):
    fake = streaming.fake
    assert fake is not None
    reply = CASES[case][1]
    planned = len(fake.encode(reply)) + 1  # and the end-of-turn token
    fake.queue(reply)
    reasoning, content, sampled_at_first_content = "", "", None
    async with aiohttp.ClientSession() as http:
        response = await open_stream(streaming, http, api)
        async for event in sse_events(response):
            more_reasoning, more_content = text_of(api, event)
            if more_content and sampled_at_first_content is None:
                (generation,) = fake.generating
                sampled_at_first_content = len(generation.tokens)
                assert not reasoning or reasoning == THOUGHT  # the reasoning came first, and whole
            reasoning += more_reasoning
            content += more_content
    assert sampled_at_first_content is not None and sampled_at_first_content < planned / 2, (
        f"the first content came after {sampled_at_first_content} of {planned} tokens"
    )
    assert (reasoning, content) == ((THOUGHT, STORY) if case == "opens_think" else ("", STORY))
    # the first turn on this engine streamed from it (its routing learned by one probe before it)
    assert [payload["stream"] for payload in fake.completions] == [True]
    assert len(fake.routing_probes) == 1 and fake.routing_probes[0]["max_tokens"] == 1
    # the stored turn is what the client saw
    (engine,) = streaming.app[keys.ENGINES].engines
    assert engine.returns_routing is False
    store = streaming.app[keys.STORE]
    (session_id,) = [state for state in store._sessions]
    node = (await store.get_nodes(session_id))[-1]
    assert node.messages[-1]["content"] == STORY
    assert node.messages[-1].get("reasoning_content") == (THOUGHT if case == "opens_think" else None)


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_a_client_leaving_after_three_content_deltas_aborts_the_call_and_records_nothing(
    streaming: ProxyHarness, case: str, api: str
):
    fake = streaming.fake
    assert fake is not None
    fake.queue(CASES[case][1])
    async with aiohttp.ClientSession() as http:
        response = await open_stream(streaming, http, api)
        before = await store_snapshot(streaming.app[keys.STORE])
        contents = 0
        async for event in sse_events(response):
            contents += bool(text_of(api, event)[1])
            if contents == 3:
                break
        response.close()  # the client goes away after three pieces of the answer
    await until(lambda: len(fake.disconnects) == 1)  # the engine saw the proxy leave
    generation = fake.generations[-1]
    await until(lambda: generation.finish_reason is not None)
    assert generation.finish_reason == "abort" and len(generation.tokens) < len(fake.encode(CASES[case][1]))
    metrics = streaming.app[keys.METRICS]
    await until(lambda: metrics.value("streamed_turns_total", api=api, outcome="disconnected") == 1)
    await asyncio.sleep(0.05)
    assert await store_snapshot(streaming.app[keys.STORE]) == before
