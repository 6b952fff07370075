"""Many sessions at once: the pools wait for a free connection instead of failing, and a wait
that runs out is a 503 with Retry-After (never a 500) that changes nothing stored.

The clients here are plain aiohttp sessions without a connection limit, so every request
really is in flight at once and the proxy's own pools are what is tested.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.state.connection import RedisOptions
from rollout_proxy.state.redis import RedisStore
from tests.harness import ADMIN_KEY, ProxyHarness, store_snapshot

USER = [{"role": "user", "content": "Tell me a story."}]
#: Sessions of the load test (1,024 in bench runs: ``ROLLOUT_PROXY_LOAD_SESSIONS=1024``).
LOAD_SESSIONS = int(os.environ.get("ROLLOUT_PROXY_LOAD_SESSIONS", "256"))
LOAD_TURNS = 3


@pytest.fixture
async def engine(tokenizer_dir: Path) -> AsyncIterator[FakeEngine]:
    # the tokenizer's own template on both sides, as the proxy runs by default: it renders locally and its
    # start-up check agrees (a template only the engine had sent every turn's rendering to /tokenize too)
    fake = FakeEngine(tokenizer_dir)
    async with FakeEngineServer(fake) as url:
        fake.url = url  # type: ignore[attr-defined]
        yield fake


async def redis_store(redis_url: str, **options: Any) -> RedisStore:
    store = await RedisStore.connect(redis_url, options=RedisOptions(**options))
    await store._redis.flushdb()
    return store


class Client:
    """Raw HTTP to the proxy, with no client-side limit on connections."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def call(
        self, method: str, path: str, body: Any, token: str = ADMIN_KEY
    ) -> tuple[int, Any, aiohttp.typedefs.LooseHeaders]:
        headers = {"Authorization": f"Bearer {token}"}
        async with self.http.request(method, self.url + path, json=body, headers=headers) as response:
            return response.status, await response.json(content_type=None), response.headers

    async def session(self) -> str:
        body = {"sample": {"messages": USER, "extra": {}}, "generation": {"max_new_tokens": 8}}
        status, answer, _ = await self.call("POST", "/v1/sessions", body)
        assert status == 201, answer
        return answer["api_key"]

    async def conversation(self, token: str, turns: int) -> list[str]:
        """``turns`` chat turns, each extending the last; the response ids."""
        messages: list[dict[str, Any]] = list(USER)
        ids = []
        for turn in range(turns):
            status, answer, _ = await self.call("POST", "/v1/chat/completions", {"messages": messages}, token)
            assert status == 200, answer
            ids.append(answer["id"])
            reply = answer["choices"][0]["message"]
            messages += [
                {"role": "assistant", "content": reply["content"]},
                {"role": "user", "content": f"more {turn}"},
            ]
        return ids

    async def close(self) -> None:
        await self.http.close()


async def test_a_tiny_redis_pool_makes_64_concurrent_turns_wait_not_fail(redis_url: str, engine: FakeEngine) -> None:
    store = await redis_store(redis_url, max_connections=2, pool_timeout=30.0)
    engine.delay = 0.02
    async with ProxyHarness.running(engine_urls=[engine.url], store=store, fake=engine) as proxy:
        client = Client(proxy.url)
        try:
            tokens = await asyncio.gather(*(client.session() for _ in range(64)))
            conversations = await asyncio.gather(*(client.conversation(token, 2) for token in tokens))
        finally:
            await client.close()
    await store.close()
    assert all(len(ids) == 2 for ids in conversations)
    assert len({ids[-1] for ids in conversations}) == 64


async def test_a_redis_pool_wait_that_runs_out_is_a_503_with_retry_after_and_stores_nothing(
    redis_url: str, engine: FakeEngine
) -> None:
    store = await redis_store(redis_url, max_connections=1, pool_timeout=0.2)
    async with ProxyHarness.running(engine_urls=[engine.url], store=store, fake=engine) as proxy:
        client = Client(proxy.url)
        try:
            token = await client.session()
            before = await store_snapshot(store)
            pool = store._redis.connection_pool
            held = await pool.get_connection()  # the pool's only connection, taken by "someone else"
            try:
                status, body, headers = await client.call("POST", "/v1/chat/completions", {"messages": USER}, token)
            finally:
                await pool.release(held)
            assert status == 503, body
            assert body["error"]["code"] == "store_busy"
            assert float(headers["Retry-After"]) >= 1
            assert await store_snapshot(store) == before
            # the connection is free again: the same turn goes through
            assert len(await client.conversation(token, 1)) == 1
        finally:
            await client.close()
    await store.close()


async def test_an_engine_pool_wait_that_runs_out_is_a_503_and_the_engine_stays_in_rotation(
    redis_url: str, engine: FakeEngine
) -> None:
    store = await redis_store(redis_url)
    engine.delay = 3.0  # the one connection stays busy well past the wait
    settings = {"engine_max_connections": 1, "engine_pool_timeout": 0.2, "rendering": "engine"}
    async with ProxyHarness.running(engine_urls=[engine.url], store=store, fake=engine, **settings) as proxy:
        client = Client(proxy.url)
        try:
            first, second = await client.session(), await client.session()
            before = await store_snapshot(store)
            slow = asyncio.create_task(client.conversation(first, 1))
            async with asyncio.timeout(60):  # the slow turn holds the engine's one connection
                while engine.inflight == 0:  # noqa: ASYNC110 (the fake engine has no event to wait on)
                    await asyncio.sleep(0.01)
            status, body, headers = await client.call("POST", "/v1/chat/completions", {"messages": USER}, second)
            assert status == 503, body
            assert body["error"]["code"] == "engine_busy"
            assert float(headers["Retry-After"]) >= 1
            assert await store_snapshot(store) == before  # the slow turn has not stored yet either
            assert len(await slow) == 1
            status, engines, _ = await client.call("GET", "/v1/admin/engines", None)
            assert status == 200 and all(row["state"] == "healthy" for row in engines["engines"]), engines
            engine.delay = 0.0
            assert len(await client.conversation(second, 1)) == 1
        finally:
            await client.close()
    await store.close()


async def test_many_concurrent_sessions_on_the_redis_store_against_a_50ms_engine_have_no_errors(
    redis_url: str, engine: FakeEngine
) -> None:
    """The load test (not timed): LOAD_SESSIONS sessions x 3 turns, all at once, 0 errors."""
    store = await redis_store(redis_url, max_connections=64)
    engine.delay = 0.05
    async with ProxyHarness.running(
        engine_urls=[engine.url], store=store, fake=engine, engine_max_connections=128
    ) as proxy:
        client = Client(proxy.url)
        try:
            tokens = await asyncio.gather(*(client.session() for _ in range(LOAD_SESSIONS)))
            conversations = await asyncio.gather(*(client.conversation(token, LOAD_TURNS) for token in tokens))
        finally:
            await client.close()
    await store.close()
    assert sum(len(ids) for ids in conversations) == LOAD_SESSIONS * LOAD_TURNS
    assert engine.max_inflight <= 128
