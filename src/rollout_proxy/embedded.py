"""Run aiohttp applications on a private event loop in a background thread.

The embedded proxy must not share an event loop with plugin code: a plugin may
block its loop (a sync ``update_state_from_messages`` inside an async rollout), and
a proxy on that same loop could then never answer. Here it keeps its own.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from aiohttp import web

from rollout_proxy.proxy.server import LISTEN_BACKLOG, start_app

T = TypeVar("T")


class BackgroundLoop:
    """One event loop in a daemon thread; ``run(coro)`` executes on it and waits."""

    def __init__(self, name: str = "rollout-proxy") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coroutine).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


async def serve_app(app: web.Application, host: str = "127.0.0.1", port: int = 0) -> tuple[web.BaseRunner, str]:
    """Start ``app`` on the current loop; returns its runner and base URL (malformed HTTP answered as JSON)."""
    runner = await start_app(app, access_log=None)
    site = web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG)
    await site.start()
    bound = runner.addresses[0][1]  # the (host, port) the site's socket was bound to
    return runner, f"http://{host}:{bound}"


class BackgroundServer:
    """An aiohttp app served from a ``BackgroundLoop``; built on that loop by ``factory``."""

    def __init__(
        self,
        factory: Callable[[], web.Application],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        loop: BackgroundLoop | None = None,
    ) -> None:
        self._factory = factory
        self._host, self._port = host, port
        self._own_loop = loop is None
        self.loop = loop or BackgroundLoop()
        self._runner: web.BaseRunner | None = None
        self.app: web.Application | None = None
        self.url = ""

    def start(self) -> str:
        async def start() -> str:
            self.app = self._factory()
            self._runner, url = await serve_app(self.app, self._host, self._port)
            return url

        self.url = self.loop.run(start())
        return self.url

    def stop(self) -> None:
        if self._runner is not None:
            self.loop.run(self._runner.cleanup())
            self._runner = None
        if self._own_loop:
            self.loop.close()

    def __enter__(self) -> BackgroundServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
