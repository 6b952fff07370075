"""A small round-robin HTTP balancer: nginx's part in docker/compose.yaml, for the local topology.

Each request goes to the next upstream in turn. An upstream that refuses the connection is
skipped and the next one tried (the request was never sent, so this is safe for a POST, as
nginx's ``proxy_next_upstream error``); once a request was sent, its answer, or its failure,
is the client's. Answers stream back as they arrive (server-sent events included), bodies
and encodings untouched. With no upstream reachable the client gets a 502 with an
OpenAI-style error body.

    python -m devtools.balancer --port 8080 --upstream http://127.0.0.1:8101 --upstream ...
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import aiohttp
from aiohttp import web

#: not forwarded either way (RFC 9110 §7.6.1), plus the length aiohttp sets itself
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
    }
)
CONNECT_TIMEOUT = 5.0


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "bad_gateway", "param": None, "code": "upstream_unreachable"}}
    return web.json_response(body, status=status)


class RoundRobinBalancer:
    """Forwards every request to ``upstreams`` in turn; ``forwarded`` counts what each one got."""

    def __init__(self, upstreams: Sequence[str], *, connect_timeout: float = CONNECT_TIMEOUT) -> None:
        if not upstreams:
            raise ValueError("a balancer needs at least one upstream")
        self.upstreams = [url.rstrip("/") for url in upstreams]
        self.forwarded: Counter[str] = Counter()
        self._next = itertools.cycle(range(len(self.upstreams)))
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=None)
        self._client: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.cleanup_ctx.append(self._client_session)
        app.router.add_route("*", "/{path:.*}", self.forward)
        return app

    async def _client_session(self, app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0)
        self._client = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        )
        yield
        await self._client.close()

    def _order(self) -> list[str]:
        """This request's upstreams: the next in turn first, then the others."""
        first = next(self._next)
        return self.upstreams[first:] + self.upstreams[:first]

    async def forward(self, request: web.Request) -> web.StreamResponse:
        assert self._client is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        peer = request.remote or ""
        headers["X-Forwarded-For"] = ", ".join(filter(None, [request.headers.get("X-Forwarded-For"), peer]))
        refused = []
        for upstream in self._order():
            try:
                upstream_response = await self._client.request(
                    request.method, upstream + request.rel_url.raw_path_qs, headers=headers, data=body
                )
            except aiohttp.ClientConnectorError as exc:
                refused.append(f"{upstream}: {exc.os_error or exc}")
                continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                return _error(502, f"the upstream failed before answering: {type(exc).__name__}")
            self.forwarded[upstream] += 1
            async with upstream_response:
                return await self._relay(request, upstream_response)
        print(f"[balancer] no upstream reachable: {'; '.join(refused)}", file=sys.stderr, flush=True)
        return _error(502, "no rollout-proxy replica is reachable")

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for key, value in upstream.headers.items():
            if key.lower() not in HOP_BY_HOP:
                response.headers.add(key, value)
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        await response.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except (aiohttp.ClientError, ConnectionResetError):
            # the upstream went away mid-answer: close the client's connection too, so it sees a cut answer
            # (as with nginx) instead of waiting for the rest
            if request.transport is not None:
                request.transport.close()
            return response
        await response.write_eof()
        return response


async def serve(port: int, upstreams: Sequence[str], host: str = "127.0.0.1") -> None:
    """Serve until SIGTERM/SIGINT."""
    balancer = RoundRobinBalancer(upstreams)
    runner = web.AppRunner(balancer.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    print(f"[balancer] http://{host}:{port} -> {', '.join(balancer.upstreams)}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.balancer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--upstream", action="append", required=True, metavar="URL")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.port, args.upstream, args.host))
    return 0


if __name__ == "__main__":
    sys.exit(main())
