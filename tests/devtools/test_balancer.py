"""The local topology's balancer (nginx's part): round robin, a replica that is down is skipped,
answers stream through untouched, and none reachable is a 502 with an OpenAI-style body."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from devtools.balancer import RoundRobinBalancer
from rollout_proxy.embedded import serve_app


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def upstream(name: str, release: asyncio.Event | None = None) -> web.Application:
    """Echoes who answered, the method, path, query, Host and body; /stream sends two SSE events."""

    async def echo(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "upstream": name,
                "method": request.method,
                "path": request.path,
                "query": dict(request.query),
                "host": request.host,
                "body": (await request.read()).decode(),
            },
            headers={"X-Upstream": name},
        )

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: first\n\n")
        assert release is not None
        await release.wait()  # the client must have had the first event before this one is sent
        await response.write(b"data: second\n\n")
        await response.write_eof()
        return response

    async def cut(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = 1000
        await response.prepare(request)
        await response.write(b"partial")
        request.transport.close()  # type: ignore[union-attr]
        return response

    app = web.Application()
    app.router.add_get("/stream", stream)
    app.router.add_get("/cut", cut)
    app.router.add_route("*", "/{path:.*}", echo)
    return app


@pytest.fixture
async def served() -> AsyncIterator[list[web.AppRunner]]:
    runners: list[web.AppRunner] = []
    yield runners
    for runner in reversed(runners):
        await runner.cleanup()


async def start(served: list[web.AppRunner], app: web.Application) -> str:
    runner, url = await serve_app(app)
    served.append(runner)
    return url


async def test_requests_go_round_robin_with_method_path_query_host_and_body(served):
    a = await start(served, upstream("a"))
    b = await start(served, upstream("b"))
    balancer = RoundRobinBalancer([a, b])
    url = await start(served, balancer.app())
    async with aiohttp.ClientSession() as client:
        answers = []
        for index in range(4):
            async with client.post(f"{url}/v1/chat/completions?x={index}", data=b'{"n": 1}') as response:
                assert response.status == 200 and response.headers["X-Upstream"] in "ab"
                answers.append(await response.json())
    assert [answer["upstream"] for answer in answers] == ["a", "b", "a", "b"]
    assert all(answer["method"] == "POST" and answer["path"] == "/v1/chat/completions" for answer in answers)
    assert [answer["query"] for answer in answers] == [{"x": str(i)} for i in range(4)]
    assert all(answer["body"] == '{"n": 1}' for answer in answers)
    assert {answer["host"] for answer in answers} == {url.removeprefix("http://")}  # the client's Host
    assert balancer.forwarded == {a: 2, b: 2}


async def test_a_replica_that_refuses_connections_is_skipped(served):
    live = await start(served, upstream("live"))
    down = closed_port_url()
    balancer = RoundRobinBalancer([down, live])
    url = await start(served, balancer.app())
    async with aiohttp.ClientSession() as client:
        for _ in range(3):
            async with client.post(f"{url}/v1/sessions", json={}) as response:
                assert response.status == 200 and (await response.json())["upstream"] == "live"
    assert balancer.forwarded == {live: 3}


async def test_no_replica_reachable_is_a_502_with_an_openai_error_body(served):
    balancer = RoundRobinBalancer([closed_port_url(), closed_port_url()])
    url = await start(served, balancer.app())
    async with aiohttp.ClientSession() as client, client.get(f"{url}/healthz") as response:
        assert response.status == 502
        error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"} and "no rollout-proxy replica" in error["message"]


async def test_answers_stream_through_as_they_come(served):
    release = asyncio.Event()
    source = await start(served, upstream("sse", release))
    url = await start(served, RoundRobinBalancer([source]).app())
    async with aiohttp.ClientSession() as client, client.get(f"{url}/stream") as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        # a balancer that buffered the answer would never hand over the first event: bounded wait
        first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), timeout=10)
        release.set()
        rest = await asyncio.wait_for(response.content.read(), timeout=10)
    assert first == b"data: first\n\n" and rest == b"data: second\n\n"


async def test_an_upstream_dying_mid_answer_cuts_the_answer_without_hanging(served):
    source = await start(served, upstream("cut"))
    url = await start(served, RoundRobinBalancer([source]).app())
    async with aiohttp.ClientSession() as client, client.get(f"{url}/cut") as response:
        with pytest.raises(aiohttp.ClientPayloadError):
            await asyncio.wait_for(response.read(), timeout=10)
