"""The server under the app: it serves through aiohttp's public API (``start_app``) as ``AppRunner`` would, a
request in flight finishes before the app is cleaned up, each connection gets the handler arguments given;
``serve``'s process settings: the cyclic garbage collector tuned for serving (``tune_gc``).

What the JSON protocol handler answers to malformed HTTP is tested in test_http_edge.py.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Iterator

import orjson
import pytest
from aiohttp import web

from rollout_proxy.embedded import serve_app
from rollout_proxy.proxy.server import LISTEN_BACKLOG, start_app, tune_gc
from tests.proxy.test_http_edge import assert_json_error, exchange

# a turn's parsed body: a dict per message, all alive while the turn runs
BODY = orjson.dumps({"messages": [{"role": "user", "content": f"turn {k}"} for k in range(400)]})


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def collections_while_holding(bodies: int) -> int:
    """Youngest-generation collections while ``bodies`` parsed turn bodies are held at once."""
    counted: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            counted.append(info["generation"])

    gc.collect()
    gc.callbacks.append(count)
    try:
        held = [orjson.loads(BODY) for _ in range(bodies)]
    finally:
        gc.callbacks.remove(count)
    assert len(held) == bodies
    return len(counted)


def test_turns_in_flight_no_longer_set_off_a_collection_every_few_turns(restored_gc):
    gc.set_threshold(700, 10, 10)  # Python's default
    assert collections_while_holding(32) >= 10
    tune_gc(50_000)
    assert gc.get_threshold() == (50_000, 10, 10)
    assert gc.get_freeze_count() > 0  # what start-up built is never walked again
    assert collections_while_holding(32) == 0


def test_cyclic_garbage_is_still_collected(restored_gc):
    tune_gc(1_000)
    gc.collect()

    class Node:
        pass

    collected: list[int] = []
    gc.callbacks.append(lambda phase, info: collected.append(info["collected"]) if phase == "stop" else None)
    try:
        for _ in range(5_000):  # cycles only a collection frees
            a, b = Node(), Node()
            a.other, b.other = b, a
    finally:
        gc.callbacks.pop()
    assert sum(collected) > 0


def test_zero_leaves_pythons_collector_alone(restored_gc):
    gc.set_threshold(700, 10, 10)
    frozen = gc.get_freeze_count()
    tune_gc(0)
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == frozen


async def test_a_request_in_flight_is_answered_before_the_app_is_cleaned_up():
    """As aiohttp's ``AppRunner``: the sites stop, ``on_shutdown`` runs, requests in flight finish, then the
    cleanup contexts close what the app opened (the store, the engines)."""
    events: list[str] = []
    entered, release, shut_down = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        entered.set()
        await release.wait()
        return web.json_response({"ok": True})

    async def resources(app: web.Application) -> AsyncIterator[None]:
        events.append("started")
        yield
        events.append("cleaned up")

    async def on_shutdown(app: web.Application) -> None:
        events.append("shutdown")
        shut_down.set()

    app = web.Application()
    app.router.add_get("/slow", slow)
    app.cleanup_ctx.append(resources)
    app.on_shutdown.append(on_shutdown)
    runner, url = await serve_app(app)
    assert events == ["started"]
    answer = asyncio.create_task(exchange(url, b"GET /slow HTTP/1.1\r\nHost: proxy\r\n\r\n"))
    await entered.wait()
    cleanup = asyncio.create_task(runner.cleanup())
    await asyncio.wait_for(shut_down.wait(), 10)
    with pytest.raises(OSError):  # no longer listening
        await exchange(url, b"GET /slow HTTP/1.1\r\nHost: proxy\r\n\r\n")
    assert events == ["started", "shutdown"]  # the request is still in flight: nothing closed under it
    release.set()
    status, _, body = await answer
    assert (status, orjson.loads(body)) == (200, {"ok": True})
    await cleanup
    assert events == ["started", "shutdown", "cleaned up"]


@pytest.mark.parametrize(("max_line_size", "status"), [(None, 200), (64, 400)])
async def test_each_connection_gets_the_handler_arguments_given(max_line_size: int | None, status: int):
    """``start_app``'s keywords reach every connection's protocol handler, as ``AppRunner``'s do: a header
    longer than ``max_line_size`` is refused, as JSON."""
    app = web.Application()

    async def empty(request: web.Request) -> web.Response:
        return web.json_response({})

    app.router.add_get("/", empty)
    limits = {} if max_line_size is None else {"max_line_size": max_line_size, "max_field_size": max_line_size}
    runner = await start_app(app, access_log=None, **limits)
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=LISTEN_BACKLOG)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        got, headers, body = await exchange(
            url, b"GET / HTTP/1.1\r\nHost: proxy\r\nX-Long: " + b"a" * 200 + b"\r\n\r\n"
        )
        assert got == status, body
        if status == 400:
            assert_json_error(headers, body, code="malformed_request")
    finally:
        await runner.cleanup()
