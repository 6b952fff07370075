"""The SDK against a real proxy and the fake engine, both on their own background loop.

Plugins may block their event loop (sync clients, sync state updates); in
production the proxy is another process, so here it runs on another thread's loop.
Raw requests go through the SDK's own transport (``ProxyClient.send``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from devtools.fake_engine import FakeEngine
from rollout_proxy.app import create_app
from rollout_proxy.embedded import BackgroundLoop, BackgroundServer, serve_app
from rollout_proxy.sdk import ChatCompletionSample, RolloutInferenceProxy
from rollout_proxy.sdk.proxy import session_body
from rollout_proxy.sdk.transport import ProxyClient
from rollout_proxy.settings import Settings
from tests.conftest import TEMPLATES
from tests.harness import ADMIN_KEY

SLOW_APPEND_SECONDS = 0.5
RELAY_HTTP = web.AppKey("relay_http", aiohttp.ClientSession)


@dataclass
class Stack:
    fake: FakeEngine
    url: str
    server: BackgroundServer
    http: ProxyClient  # no token of its own: each request names its own

    def request(self, method: str, path: str, body: Any = None, token: str = ADMIN_KEY) -> tuple[int, Any]:
        return self.http.send(method, path, json=body, headers={"Authorization": f"Bearer {token}"})

    def session(
        self, sample: ChatCompletionSample, *, n_sample: int | None = None, via: str | None = None
    ) -> RolloutInferenceProxy:
        """A rollout session, handed to the plugin as the runner would (``via``: another proxy root)."""
        status, created = self.request("POST", "/v1/sessions", session_body(sample, n_sample=n_sample))
        assert status == 201, created
        base_url = f"{via}/v1" if via else created["base_url"]
        return RolloutInferenceProxy(base_url, created["api_key"], sample=sample)

    def finish(self, proxy: RolloutInferenceProxy, result: dict[str, Any]) -> dict[str, Any]:
        status, body = self.request("POST", f"/v1/sessions/{proxy.session_id}/finish", result)
        assert status == 200, body
        return body


@pytest.fixture
def stack(tokenizer_dir: Path) -> Iterator[Stack]:
    loop = BackgroundLoop("test-stack")
    fake = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"])
    fake_runner, fake_url = loop.run(serve_app(fake.app()))
    server = BackgroundServer(lambda: create_app(Settings(engines=(fake_url,), admin_key=ADMIN_KEY)), loop=loop)
    server.start()
    with ProxyClient(server.url, None) as http:
        yield Stack(fake=fake, url=server.url, server=server, http=http)
    server.stop()
    loop.run(fake_runner.cleanup())
    loop.close()


@dataclass
class Relay:
    """A real HTTP relay in front of the stack: it records what passes (``"METHOD /path"``)
    and holds every appended-messages request ``append_delay`` seconds before forwarding."""

    target: str
    append_delay: float = 0.0
    seen: list[str] = field(default_factory=list)
    url: str = ""

    def app(self) -> web.Application:
        async def client(app: web.Application):
            async with aiohttp.ClientSession() as http:
                app[RELAY_HTTP] = http
                yield

        async def forward(request: web.Request) -> web.Response:
            self.seen.append(f"{request.method} {request.path}")
            if request.method == "POST" and request.path.endswith("/messages"):
                await asyncio.sleep(self.append_delay)
            headers = {
                name: request.headers[name] for name in ("Authorization", "Content-Type") if name in request.headers
            }
            async with request.app[RELAY_HTTP].request(
                request.method, self.target + request.path_qs, data=await request.read(), headers=headers
            ) as answer:
                body = await answer.read()
                return web.Response(status=answer.status, body=body, content_type=answer.content_type)

        app = web.Application()
        app.cleanup_ctx.append(client)
        app.router.add_route("*", "/{tail:.*}", forward)
        return app


@pytest.fixture
def relay(stack: Stack) -> Iterator[Relay]:
    """The stack behind a relay on the stack's own background loop (another thread than the test's)."""
    relay = Relay(stack.url)
    server = BackgroundServer(relay.app, loop=stack.server.loop)
    relay.url = server.start()
    yield relay
    server.stop()


@pytest.fixture
def slow_relay(relay: Relay) -> Relay:
    """The relay, with appended messages answered only after ``SLOW_APPEND_SECONDS``."""
    relay.append_delay = SLOW_APPEND_SECONDS
    return relay
