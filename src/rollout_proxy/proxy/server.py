"""The HTTP server under the app: what aiohttp refuses before any handler runs, as JSON.

A request line or header too long, bad chunking, conflicting lengths, an unknown method,
a ``Content-Encoding`` aiohttp cannot decode: aiohttp answers these from its protocol
handler (``RequestHandler.handle_error``), outside the app and its middleware, with a
plain-text body. ``JsonRequestHandler`` answers them as OpenAI-style errors instead.
``start_app`` starts an app as aiohttp's ``AppRunner`` would, through aiohttp's public API
only: an ``AppRunner`` starts the app and makes its ``web.Server``; a ``JsonServer`` (a
``web.Server``, the protocol factory a site listens with) takes that server's handler and
request factory and makes ``JsonRequestHandler`` connections; a ``ProxyRunner`` (a
``web.ServerRunner``) serves it and, at cleanup, shuts the app down as ``AppRunner`` does.
Everything that serves the app (``embedded.serve_app``, ``rollout-proxy serve``) runs it so;
``serve_until_stopped`` is the command line's loop around it.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError, LineTooLong

from rollout_proxy.errors import InvalidRequest, ProxyError, StoreUnavailable, UnsupportedMediaType
from rollout_proxy.proxy.http import json_response

log = structlog.get_logger(__name__)


def protocol_error(status: int, exc: BaseException | None, message: str | None) -> ProxyError:
    """The error tree's word for what aiohttp's protocol handler gives up on."""
    if status >= 500:  # 504: a handler's timeout escaped the middleware; 500: a bug
        return ProxyError("internal error; see the proxy's log", code="timeout" if status == 504 else None)
    if isinstance(exc, ContentEncodingError):  # raised while parsing headers: an encoding aiohttp cannot decode
        return UnsupportedMediaType("this Content-Encoding is not supported: send the body as is, gzip or deflate")
    if isinstance(exc, LineTooLong):
        reason = "the request line or a header is too long"
    elif isinstance(exc, HttpProcessingError) and exc.message:
        reason = exc.message.splitlines()[0].rstrip(":")
    else:
        reason = (message or "bad request").splitlines()[0]
    return InvalidRequest(f"malformed HTTP request: {reason}", code="malformed_request")


class JsonRequestHandler(web.RequestHandler):
    """aiohttp's protocol handler for one connection, answering what it refuses in our error shape."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's ``handle_error`` with an OpenAI-style body (and without a traceback for a client's mistake)."""
        if request.writer.output_size > 0:  # as aiohttp: an answer has started, the connection is broken
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:
            log.info("malformed_request", status=status, remote=request.remote, error=str(exc or message))
        error = protocol_error(status, exc, message)
        response = json_response(error.to_body(), status=error.status if status < 500 else status)
        response.force_close()
        return response


class JsonServer(web.Server):
    """A ``web.Server`` whose connections are served by ``JsonRequestHandler``, each made with the handler
    arguments this server was made with (aiohttp's own ``__call__`` does the same with ``RequestHandler``)."""

    def __init__(
        self,
        handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
        *,
        request_factory: Callable[..., web.BaseRequest] | None = None,
        handler_cancellation: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, request_factory=request_factory, handler_cancellation=handler_cancellation, **kwargs)
        self.serving_loop = asyncio.get_running_loop()
        self.handler_args = kwargs

    def __call__(self) -> web.RequestHandler:
        return JsonRequestHandler(self, loop=self.serving_loop, **self.handler_args)


class ProxyRunner(web.ServerRunner):
    """A ``web.ServerRunner`` of a ``JsonServer`` serving ``app`` (``start_app``): its cleanup stops the sites,
    lets requests in flight finish and closes the connections, then shuts the app down as aiohttp's
    ``AppRunner`` does (``on_shutdown`` once the sites are stopped, ``on_cleanup`` and the cleanup contexts
    last)."""

    def __init__(self, server: JsonServer, app: web.Application, **kwargs: Any) -> None:
        super().__init__(server, **kwargs)
        self.app = app

    async def shutdown(self) -> None:
        await self.app.shutdown()

    async def cleanup(self) -> None:
        try:
            await super().cleanup()
        finally:
            await self.app.cleanup()


async def start_app(app: web.Application, *, shutdown_timeout: float = 60.0, **handler_args: Any) -> ProxyRunner:
    """``app`` started (its ``on_startup`` and cleanup contexts run), set up to be served through a
    ``JsonServer``: pass the runner to a ``web.TCPSite``. ``handler_args`` go to each connection's
    ``RequestHandler`` (``access_log=None``, ``max_line_size``, ...), as ``web.AppRunner``'s keywords do; an
    application's own ``handler_args`` are not read (aiohttp keeps them private)."""
    made = web.AppRunner(app, **handler_args)
    try:
        await made.setup()  # starts the app and makes aiohttp's server for it: its handler and request factory
    except BaseException:  # a part that could not start (its store unreachable): close those started before it
        await app.cleanup()
        raise
    # ``made`` serves nothing and is never cleaned up: the ProxyRunner shuts the app down, once
    assert made.server is not None
    server = JsonServer(
        made.server.request_handler,
        request_factory=made.server.request_factory,
        handler_cancellation=made.server.handler_cancellation,
        **handler_args,
    )
    runner = ProxyRunner(server, app, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    return runner


#: Connections the kernel queues before ``accept`` (capped by net.core.somaxconn): as vLLM's, so a burst of
#: a thousand plugins connecting at once is queued rather than refused and retried (aiohttp's default is 128).
LISTEN_BACKLOG = 2048


def tune_gc(threshold: int) -> None:
    """Fewer, cheaper cyclic collections in a serving process (``threshold`` 0: Python's own, untouched).

    Python collects its youngest generation each time 700 more container objects are alive than
    at the last collection; a turn holds hundreds (its parsed body alone: a dict per message), so
    with a few dozen turns in flight that is a collection every few turns, ~0.3 ms a turn here
    (README "Performance"). Objects freed by their reference count never wait for a collection:
    only garbage in reference cycles does, and it is bounded by ``threshold``. What start-up built
    (modules, the app) is frozen first, so no later collection walks it again.
    """
    if threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(threshold, middle, oldest)


class CannotServe(Exception):
    """The app could not start serving: a store it cannot reach, an address it cannot listen on (the command
    line prints the message, not a traceback)."""


async def _started_unless_stopped(
    app: web.Application, stop: asyncio.Event, shutdown_timeout: float
) -> ProxyRunner | None:
    """``app`` started, or None where ``stop`` was set first (a Ctrl-C while the store is retried: the start is
    cancelled and what it had opened closed, not waited for)."""
    starting = asyncio.ensure_future(start_app(app, access_log=None, shutdown_timeout=shutdown_timeout))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((starting, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not starting.done():
            starting.cancel()
            await asyncio.wait((starting,))
    if starting.cancelled():
        log.info("stopped_while_starting")
        return None
    try:
        return starting.result()
    except StoreUnavailable as exc:
        raise CannotServe(exc.message) from exc


async def serve_until_stopped(
    app: web.Application,
    host: str,
    port: int,
    *,
    shutdown_timeout: float = 60.0,
    reuse_port: bool = False,
    gc_threshold: int = 0,
    on_listening: Callable[[int], None] | None = None,
) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then shut down gracefully (``reuse_port``: share the port with
    the other workers of ``serve --workers``, SO_REUSEPORT; ``gc_threshold``: ``tune_gc``, once started;
    ``on_listening``: called with the port once it is open, the one the system chose for ``port`` 0).

    Graceful: stop accepting, give requests in flight up to ``shutdown_timeout`` seconds to
    finish, then close the store and engines (the app's cleanup contexts).
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    runner: ProxyRunner | None = None
    try:
        runner = await _started_unless_stopped(app, stop, shutdown_timeout)
        if runner is None:
            return
        tune_gc(gc_threshold)  # after the app's start-up, before the first request
        site = web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG, reuse_port=reuse_port or None)
        try:
            await site.start()
        except OSError as exc:  # the port taken, an address not this machine's
            # a bind's error says its errno in a sentence of its own; a name that does not resolve, its own words
            reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror or str(exc)
            raise CannotServe(f"cannot listen on {host}:{port}: {reason}") from exc
        if on_listening is not None:
            on_listening(runner.addresses[0][1])
        await stop.wait()
        log.info("shutting_down", grace_s=shutdown_timeout)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        if runner is not None:
            await runner.cleanup()
