"""The SDK transport against a real local HTTP server (port 0, another thread), sync and async."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from rollout_proxy.embedded import BackgroundServer
from rollout_proxy.sdk import ProxyRequestError, ProxyUnreachable
from rollout_proxy.sdk.transport import ProxyClient

OPENAI_ERROR = {
    "error": {
        "message": "do not set 'temperature'",
        "type": "invalid_request_error",
        "param": "temperature",
        "code": "pinned_generation_parameter",
    }
}


@dataclass
class Upstream:
    """What the server saw: one ``(method, path, client port, authorization, body)`` per request."""

    url: str = ""
    seen: list[tuple[str, str, int, str | None, bytes]] = field(default_factory=list)

    @property
    def ports(self) -> list[int]:
        return [port for _, _, port, _, _ in self.seen]

    def app(self) -> web.Application:
        async def record(request: web.Request) -> None:
            port = request.transport.get_extra_info("peername")[1] if request.transport else -1
            body = await request.read()
            self.seen.append((request.method, request.path, port, request.headers.get("Authorization"), body))

        async def echo(request: web.Request) -> web.Response:
            await record(request)
            return web.json_response({"path": request.path, "body": (await request.read()).decode() or None})

        async def openai_error(request: web.Request) -> web.Response:
            await record(request)
            return web.json_response(OPENAI_ERROR, status=400)

        async def text_error(request: web.Request) -> web.Response:
            await record(request)
            return web.Response(status=502, text="upstream fell over")

        async def empty(request: web.Request) -> web.Response:
            await record(request)
            return web.Response(status=204)

        app = web.Application()
        app.router.add_route("*", "/echo", echo)
        app.router.add_route("*", "/openai-error", openai_error)
        app.router.add_route("*", "/text-error", text_error)
        app.router.add_route("*", "/empty", empty)
        return app


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    upstream = Upstream()
    with BackgroundServer(upstream.app) as server:
        upstream.url = server.url
        yield upstream


@pytest.fixture(params=["sync", "async"])
def flavour(request: pytest.FixtureRequest) -> str:
    return request.param


async def call(client: ProxyClient, flavour: str, name: str, *args: Any, **kwargs: Any) -> Any:
    """``client.<name>(...)`` in the sync flavour, ``await client.a<name>(...)`` in the async one."""
    if flavour == "sync":
        return getattr(client, name)(*args, **kwargs)
    return await getattr(client, f"a{name}")(*args, **kwargs)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_construction_does_no_io(upstream: Upstream, flavour: str):
    client = ProxyClient(upstream.url, "k")
    await call(client, flavour, "close")
    assert upstream.seen == []


async def test_json_answer_is_parsed_and_the_token_sent(upstream: Upstream, flavour: str):
    client = ProxyClient(upstream.url + "/", "k")
    assert await call(client, flavour, "post", "/echo", {"a": [1, "é"]}) == {"path": "/echo", "body": '{"a":[1,"é"]}'}
    assert await call(client, flavour, "get", "/echo", token="other") == {"path": "/echo", "body": None}
    assert await call(client, flavour, "request", "GET", "/empty") is None  # no content, no JSON
    assert [(method, auth) for method, _, _, auth, _ in upstream.seen] == [
        ("POST", "Bearer k"),
        ("GET", "Bearer other"),  # a per-call token replaces the client's
        ("GET", "Bearer k"),
    ]
    await call(client, flavour, "close")


async def test_openai_error_raises_with_its_fields(upstream: Upstream, flavour: str):
    client = ProxyClient(upstream.url, "k")
    with pytest.raises(ProxyRequestError) as raised:
        await call(client, flavour, "post", "/openai-error", {"temperature": 0.1}, what="creating a thing")
    error = raised.value
    assert not isinstance(error, ProxyUnreachable)
    assert (error.status, error.body) == (400, OPENAI_ERROR)
    assert (error.message, error.type, error.param, error.code) == (
        "do not set 'temperature'",
        "invalid_request_error",
        "temperature",
        "pinned_generation_parameter",
    )
    assert str(error) == "creating a thing failed (400): do not set 'temperature'"
    await call(client, flavour, "close")


async def test_non_json_error_body_is_kept_as_text(upstream: Upstream, flavour: str):
    client = ProxyClient(upstream.url, "k")
    with pytest.raises(ProxyRequestError) as raised:
        await call(client, flavour, "get", "/text-error")
    error = raised.value
    assert (error.status, error.body, error.message) == (502, "upstream fell over", "upstream fell over")
    assert error.error == {} and error.type is None and error.param is None and error.code is None
    assert str(error) == "GET /text-error failed (502): upstream fell over"
    await call(client, flavour, "close")


async def test_refused_connection_raises_unreachable(flavour: str):
    client = ProxyClient(f"http://127.0.0.1:{free_port()}", "k")
    with pytest.raises(ProxyUnreachable) as raised:
        await call(client, flavour, "post", "/v1/sessions", {}, what="creating a session")
    error = raised.value
    assert isinstance(error, ProxyRequestError) and error.status is None and error.body is None
    assert str(error).startswith("creating a session failed (no answer): ConnectError")
    assert isinstance(error.__cause__, Exception)  # the transport library's error, kept only as the cause
    await call(client, flavour, "close")


async def test_one_pool_is_reused_and_closed(upstream: Upstream, flavour: str):
    client = ProxyClient(upstream.url, "k")
    for _ in range(3):
        await call(client, flavour, "get", "/echo")
    assert len(set(upstream.ports)) == 1  # one kept-alive connection served every call
    pool = client._sync if flavour == "sync" else client._async
    assert pool is not None and not pool.is_closed
    await call(client, flavour, "close")
    assert pool.is_closed
    await call(client, flavour, "get", "/echo")  # usable again: a fresh pool, a new connection
    assert len(set(upstream.ports)) == 2
    await call(client, flavour, "close")


async def test_context_managers_close_the_pools(upstream: Upstream):
    with ProxyClient(upstream.url, "k") as client:
        client.get("/echo")
        sync_pool = client._sync
    assert sync_pool is not None and sync_pool.is_closed
    async with ProxyClient(upstream.url, "k") as client:
        client.get("/echo")
        await client.aget("/echo")
        pools = (client._sync, client._async)
    assert all(pool is not None and pool.is_closed for pool in pools)  # aclose closes both


async def test_send_answers_error_statuses_and_sends_raw_bytes(upstream: Upstream, flavour: str):
    client = ProxyClient(upstream.url, None)
    assert await call(client, flavour, "send", "GET", "/openai-error") == (400, OPENAI_ERROR)
    assert await call(client, flavour, "send", "GET", "/text-error") == (502, "upstream fell over")
    status, body = await call(
        client, flavour, "send", "POST", "/echo", content=b'{"messages": [', headers={"Authorization": "Bearer t"}
    )
    assert (status, body) == (200, {"path": "/echo", "body": '{"messages": ['})
    assert [auth for _, _, _, auth, _ in upstream.seen] == [None, None, "Bearer t"]  # no token: none sent
    assert upstream.seen[-1][-1] == b'{"messages": ['
    await call(client, flavour, "close")


async def test_an_absolute_url_overrides_the_base(upstream: Upstream, flavour: str):
    client = ProxyClient("http://127.0.0.1:9/never", "k")
    assert await call(client, flavour, "get", upstream.url + "/echo") == {"path": "/echo", "body": None}
    await call(client, flavour, "close")
