"""A running proxy for tests, reached over real HTTP (the openai SDK needs a socket).

Raw requests go through the SDK's own transport (``ProxyClient.asend``), so the tests
exercise the one HTTP client plugins use.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import openai
from aiohttp import web

from devtools.fake_engine import FakeEngine
from rollout_proxy.app import create_app
from rollout_proxy.embedded import serve_app
from rollout_proxy.sdk.transport import ProxyClient
from rollout_proxy.settings import Settings

ADMIN_KEY = "test-admin-key"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}


@dataclass
class Session:
    session_id: str
    base_url: str
    api_key: str
    expires_at: int
    client: openai.AsyncOpenAI


@dataclass
class ProxyHarness:
    url: str
    app: web.Application
    fake: FakeEngine | None
    http: ProxyClient  # no token of its own: each request names its own
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    @classmethod
    @asynccontextmanager
    async def running(
        cls,
        *,
        engine_urls: Sequence[str],
        store: Any = None,
        fake: FakeEngine | None = None,
        store_url: str = "memory",
        **settings: Any,
    ) -> AsyncIterator[ProxyHarness]:
        """A proxy on a free port; ``store`` is injected, else opened from ``store_url``."""
        config = Settings(engines=tuple(engine_urls), admin_key=ADMIN_KEY, store=store_url, **settings)
        app = create_app(config, store=store)
        runner, url = await serve_app(app)
        harness = cls(url=url, app=app, fake=fake, http=ProxyClient(url, None))
        try:
            yield harness
        finally:
            for client in harness.clients:
                await client.close()
            await harness.http.aclose()
            await runner.cleanup()

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        data: bytes | None = None,
        token: str | None = ADMIN_KEY,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        all_headers = dict(headers or {})
        if token is not None:
            all_headers["Authorization"] = f"Bearer {token}"
        return await self.http.asend(method, path, json=json, content=data, headers=all_headers)

    async def create_session(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
        n_sample: int | None = None,
        policy: str | None = None,
        **generation: Any,
    ) -> Session:
        sample: dict[str, Any] = {"messages": messages, "extra": extra or {}}
        if tools is not None:
            sample["tools"] = tools
        body: dict[str, Any] = {"sample": sample, "generation": {"max_new_tokens": 256, **generation}}
        if n_sample is not None:
            body["n_sample"] = n_sample
        if policy is not None:
            body["policy"] = policy
        status, body = await self.request("POST", "/v1/sessions", json=body)
        assert status == 201, body
        return Session(client=self.client(body["base_url"], body["api_key"]), **body)

    def client(self, base_url: str, api_key: str) -> openai.AsyncOpenAI:
        """An openai client closed with the harness."""
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        self.clients.append(client)
        return client

    async def trajectory(self, response_id: str) -> dict[str, Any]:
        status, body = await self.request("GET", f"/v1/responses/{response_id}/trajectory")
        assert status == 200, body
        return body


async def store_snapshot(store: Any) -> Any:
    """Everything a store holds, comparable with ==, to prove a request changed nothing."""
    from rollout_proxy.state.memory import MemoryStore

    if isinstance(store, MemoryStore):
        return {
            session_id: (
                state.session.to_dict(),
                sorted(state.nodes),
                dict(state.paths),
                dict(state.latest),
                sorted(state.images),
                state.image_bytes,
            )
            for session_id, state in store._sessions.items()
        }
    client = store._redis
    snapshot = {}
    for key in sorted(await client.keys("rp:*")):
        kind = await client.type(key)
        if kind == b"zset":  # the session listing's index
            snapshot[key] = await client.zrange(key, 0, -1, withscores=True)
        else:
            snapshot[key] = await client.hgetall(key) if kind == b"hash" else await client.get(key)
    return snapshot
