"""Streamed turns when something breaks: the client leaves, an engine fails before or after the first byte.

In every case the store holds a streamed turn only if it completed, and then exactly as a
non-streamed turn would (the fake fleet's ``check_trajectory`` accounts for every token).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import openai
import pytest

from devtools.fake_engine import FakeMoE
from rollout_proxy.proxy import keys
from tests.fakes import FakeFleet, fake_fleet
from tests.harness import ProxyHarness, store_snapshot

QUESTION = [{"role": "user", "content": "Tell me a long story about rivers."}]
STORY = " ".join(f"river{n}" for n in range(60))


async def until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    async with asyncio.timeout(seconds):
        while not condition():  # noqa: ASYNC110 (the engine's handler updates it; polling is simplest)
            await asyncio.sleep(0.01)


def streams_for_real(proxy: ProxyHarness) -> None:
    """As after a first plain turn on each engine: they are known to return no routing, so they stream."""
    for engine in proxy.app[keys.ENGINES].engines:
        engine.returns_routing = False


@pytest.fixture
async def fakes(tokenizer_dir):
    async with fake_fleet(tokenizer_dir, 2) as fleet:
        yield fleet


async def test_a_client_that_leaves_mid_stream_aborts_the_engine_call_and_nothing_is_recorded(tokenizer_dir):
    async with fake_fleet(tokenizer_dir, 1, delay=3.0) as fakes, ProxyHarness.running(engine_urls=fakes.urls) as proxy:
        streams_for_real(proxy)
        fake = fakes.engines[0]
        fake.queue(STORY)
        session = await proxy.create_session(QUESTION, max_new_tokens=200)
        before = await store_snapshot(proxy.app[keys.STORE])
        stream = await session.client.chat.completions.create(model="m", messages=QUESTION, stream=True)
        seen = []
        async for chunk in stream:
            seen += chunk.choices[0].model_extra.get("token_ids") or [] if chunk.choices else []
            if len(seen) >= 3:
                break
        await stream.close()  # the client goes away after three tokens

        await until(lambda: len(fake.disconnects) == 1)  # the engine saw its client (the proxy) leave
        generation = fake.generations[-1]
        await until(lambda: generation.finish_reason is not None)
        assert generation.finish_reason == "abort"
        assert len(generation.tokens) < len(fake.encode(STORY))  # it stopped generating
        metrics = proxy.app[keys.METRICS]
        await until(lambda: metrics.value("streamed_turns_total", api="chat", outcome="disconnected") == 1)
        assert await store_snapshot(proxy.app[keys.STORE]) == before


async def test_an_engine_failing_before_the_first_byte_fails_over_invisibly(fakes: FakeFleet):
    async with ProxyHarness.running(engine_urls=fakes.urls) as proxy:
        streams_for_real(proxy)
        fakes.engines[0].queue(STORY)
        fakes.engines[1].queue(STORY)
        session = await proxy.create_session(QUESTION)
        record = await proxy.app[keys.SESSIONS].get(session.session_id)
        first = fakes.by_url(record.engine)
        first.failures.append((500, "injected: fails before answering"))
        stream = await session.client.chat.completions.create(model="m", messages=QUESTION, stream=True)
        chunks = [chunk async for chunk in stream]
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        assert text == STORY
        assert len(first.completions) == 1  # the failed call; the other engine answered
        assert sum(len(engine.completions) for engine in fakes.engines) == 2
        fakes.check_trajectory(await proxy.trajectory(chunks[0].id))
        assert proxy.app[keys.METRICS].value("streamed_turns_total", api="chat", outcome="completed") == 1


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_an_engine_failing_after_the_first_byte_ends_the_stream_with_an_error_event(fakes: FakeFleet, api):
    async with ProxyHarness.running(engine_urls=fakes.urls) as proxy:
        streams_for_real(proxy)
        for engine in fakes.engines:
            engine.queue(STORY)
            engine.set_fault("reset")  # the connection is reset after the first streamed token
        session = await proxy.create_session(QUESTION)
        before = await store_snapshot(proxy.app[keys.STORE])
        received = []
        if api == "chat":
            with pytest.raises(openai.APIError) as raised:
                stream = await session.client.chat.completions.create(model="m", messages=QUESTION, stream=True)
                async for chunk in stream:
                    received.append(chunk)
            error = raised.value.body
            assert error["type"] == "upstream_error" and error["code"] == "stream_interrupted"
        else:
            async with session.client.responses.stream(model="m", input=QUESTION) as stream:
                async for event in stream:
                    received.append(event)
            assert received[-1].type == "error" and received[-1].code == "stream_interrupted"
            assert "response.completed" not in [event.type for event in received]
        assert received  # the failure came after the first byte
        # the other engine was never asked to start over: what the client saw cannot be taken back
        assert sum(len(engine.completions) for engine in fakes.engines) == 1
        assert await store_snapshot(proxy.app[keys.STORE]) == before
        assert proxy.app[keys.METRICS].value("streamed_turns_total", api=api, outcome="failed") == 1


async def test_every_engine_down_before_the_first_byte_is_an_ordinary_503(fakes: FakeFleet):
    async with ProxyHarness.running(engine_urls=fakes.urls) as proxy:
        session = await proxy.create_session(QUESTION)
        for engine in fakes.engines:
            engine.set_fault("error")
        with pytest.raises(openai.APIStatusError) as raised:
            await session.client.chat.completions.create(model="m", messages=QUESTION, stream=True)
        assert raised.value.status_code in (502, 503)
        assert raised.value.body["type"] in ("upstream_error", "service_unavailable")


@pytest.mark.parametrize("policy", ["continue", "regenerate"])
async def test_an_abort_pause_during_a_stream(tokenizer_dir, policy: str):
    """continue: the stream just runs longer (the continued call starts from the tokens already sent);
    regenerate: what was sent cannot be taken back, so the stream ends with an error and nothing is recorded."""
    settings = {"abort_policy": policy, "engine_probe_interval": 0.2, "pause_wait": 60.0}
    async with (
        fake_fleet(tokenizer_dir, 1, delay=2.0) as fakes,
        ProxyHarness.running(engine_urls=fakes.urls, **settings) as proxy,
    ):
        streams_for_real(proxy)
        fake = fakes.engines[0]
        fake.queue(STORY, STORY)
        session = await proxy.create_session(QUESTION, max_new_tokens=200)
        before = await store_snapshot(proxy.app[keys.STORE])
        stream = await session.client.chat.completions.create(model="m", messages=QUESTION, stream=True)
        chunks, tokens, failed = [], [], None
        try:
            async for chunk in stream:
                chunks.append(chunk)
                tokens += (chunk.choices[0].model_extra.get("token_ids") or []) if chunk.choices else []
                if len(tokens) == 3:
                    status, _ = await proxy.request("POST", "/v1/admin/pause", json={"mode": "abort"})
                    assert status == 200
                    status, _ = await proxy.request("POST", "/v1/admin/resume", json={"policy_version": 1})
                    assert status == 200
        except openai.APIError as exc:
            failed = exc
        assert fake.pauses == ["abort"]
        if policy == "regenerate":
            assert failed is not None and failed.body["code"] == "stream_interrupted"
            assert await store_snapshot(proxy.app[keys.STORE]) == before
            return
        assert failed is None
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        trajectory = await proxy.trajectory(chunks[0].id)
        # the client saw exactly what was recorded: the cut call's tokens, then the continuation's
        assert text == trajectory["messages"][-1]["content"]
        assert trajectory["total_token_ids"][-len(tokens) :] == tokens and sum(trajectory["total_loss_weight"]) == len(
            tokens
        )
        fakes.check_trajectory(trajectory)  # version 0 tokens, then version 1: as the engine sampled them
        assert {span["version"] for span in trajectory["policy_versions"]} == {0, 1}


async def test_an_moe_engines_turn_is_one_plain_call_relayed_with_its_routing(tokenizer_dir):
    async with fake_fleet(tokenizer_dir, 1) as fakes, ProxyHarness.running(engine_urls=fakes.urls) as proxy:
        fake = fakes.engines[0]
        fake.moe = FakeMoE(num_layers=3, top_k=2, num_experts=8)
        fake.queue(STORY, STORY)
        session = await proxy.create_session(QUESTION, max_new_tokens=200)
        plain = await session.client.chat.completions.create(model="m", messages=QUESTION)
        stream = await session.client.chat.completions.create(model="m", messages=QUESTION, stream=True)
        chunks = [chunk async for chunk in stream]
        assert [payload.get("stream") for payload in fake.completions] == [False, False]  # vLLM streams no routing
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
        )
        streamed, expected = await proxy.trajectory(chunks[0].id), await proxy.trajectory(plain.id)
        for key in ("total_token_ids", "total_loss_weight", "total_token_logprobs", "routed_experts"):
            assert streamed[key] == expected[key], key
        assert streamed["routed_experts"] is not None
