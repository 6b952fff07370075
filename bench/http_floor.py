"""What the HTTP stack alone costs per turn, next to the proxy: the floor under its CPU per turn.

    python bench/http_floor.py                      # 32 sessions x 20 turns, 4 interleaved rounds
    python bench/http_floor.py --sessions 128 --turns 10 --rounds 2

Issue 14 asks for ≤ 0.5 ms of the proxy's CPU per turn. Every turn, whatever the proxy does with it,
is one HTTP request served and one HTTP request made to the engine. This runs, in front of the same
engine process (``load_tests.engine``, 0 ms, fixed 16-token reply) and on the same stack as
``rollout-proxy serve`` (aiohttp, uvloop, orjson), two servers that do nothing else:

  server only     reads the Chat Completions body, parses it, answers a canned chat completion
  forwarder       the same, and in between one token-in ``/v1/completions`` call to the engine with
                  vLLM's settings and ``return_token_ids`` (a prompt that grows with the history, as
                  the proxy's does: 40 ids plus 30 per message), its answer parsed and its text returned
  raw forwarder   the forwarder with aiohttp's client swapped for a few lines on an asyncio protocol
                  (keep-alive, Content-Length answers only, no timeouts or errors handled): a what-if,
                  what the client's own work costs, not something to serve with

and ``rollout-proxy serve`` on the memory store (``--proxy-options`` adds serve options). The three
alternate round by round (the order flips), and the CPU per turn of each comes from its own
process's counters, as in ``bench/proxy_overhead.py``. What the proxy spends above the forwarder is
its own work: sessions, rendering, the tree, the trajectory, validation, metrics. Writes
``http_floor.json`` under ``--out``. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from proxy_overhead import Target  # noqa: E402
from serve_options import interleaved, summary  # noqa: E402
from serve_options import start as start_proxy  # noqa: E402

from load_tests.run import Services, free_port, start_engine  # noqa: E402


def canned_answer(text: str, prompt_tokens: int) -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-floor",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "policy",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 16, "total_tokens": prompt_tokens + 16},
        }
    )


class RawConnection(asyncio.Protocol):
    """One keep-alive connection that reads answers with a Content-Length (the engine double's)."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.answer: asyncio.Future[bytes] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.answer is None:
            return
        head = bytes(self.buffer[:end]).lower()
        at = head.index(b"content-length:") + len(b"content-length:")
        length = int(head[at : head.index(b"\r\n", at)])
        if len(self.buffer) >= end + 4 + length:
            body = bytes(self.buffer[end + 4 : end + 4 + length])
            del self.buffer[: end + 4 + length]
            self.answer.set_result(body)


class RawClient:
    def __init__(self, engine_url: str) -> None:
        self.host, _, port = engine_url.removeprefix("http://").partition(":")
        self.port = int(port)
        self.idle: list[RawConnection] = []

    async def post(self, path: str, body: bytes) -> bytes:
        loop = asyncio.get_running_loop()
        if self.idle:
            connection = self.idle.pop()
        else:
            _, connection = await loop.create_connection(RawConnection, self.host, self.port)
        connection.answer = loop.create_future()
        head = f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
        connection.transport.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        answer = await connection.answer
        self.idle.append(connection)
        return answer

    async def close(self) -> None:
        for connection in self.idle:
            connection.transport.close()


def floor_app(engine_url: str | None, raw: bool = False) -> web.Application:
    """The bare server: with ``engine_url`` a forwarder (``raw``: on ``RawClient``), without it the server alone."""
    app = web.Application()
    http: web.AppKey[Any] = web.AppKey("http", object)

    async def client(app: web.Application) -> Any:
        app[http] = RawClient(engine_url) if raw else aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4096))
        yield
        await app[http].close()

    async def call_engine(request: web.Request, payload: bytes) -> bytes:
        if raw:
            return await request.app[http].post("/v1/completions", payload)
        headers = {"Content-Type": "application/json"}
        async with request.app[http].post(f"{engine_url}/v1/completions", data=payload, headers=headers) as answer:
            return await answer.read()

    async def chat(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        prompt = list(range(100, 140 + 30 * len(body["messages"])))
        if engine_url is None:
            return web.Response(
                body=canned_answer("The answer is forty-two.", len(prompt)), content_type="application/json"
            )
        payload = {
            "model": "policy",
            "prompt": prompt,
            "max_tokens": body.get("max_tokens", 16),
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "n": 1,
            "logprobs": 0,
            "return_token_ids": True,
            "stream": False,
        }
        completion = orjson.loads(await call_engine(request, orjson.dumps(payload)))
        text = completion["choices"][0]["text"]
        return web.Response(body=canned_answer(text, len(prompt)), content_type="application/json")

    if engine_url is not None:
        app.cleanup_ctx.append(client)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    return app


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def serve_forever(app: web.Application, port: int) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=2048).start()
    await asyncio.Event().wait()


def serve_floor(port: int, engine_url: str | None, raw: bool) -> None:
    """The floor server's process (``--serve-floor``), on uvloop as ``rollout-proxy serve`` is; SIGTERM ends it."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve_forever(floor_app(engine_url, raw), port))


def start_floor(services: Services, name: str, engine_url: str | None, raw: bool = False) -> Target:
    port = free_port()
    argv = [sys.executable, __file__, "--serve-floor", str(port), *(["--engine", engine_url] if engine_url else [])]
    argv += ["--raw"] if raw else []
    process = services.start(name, argv)
    services.wait_http(name, f"http://127.0.0.1:{port}/health")
    return Target(name, f"http://127.0.0.1:{port}/v1/chat/completions", process.pid)


async def run(args: argparse.Namespace, targets: list[Target], engine_pid: int) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        runs = await interleaved(http, args, targets, engine_pid)
    return {name: summary(each) for name, each in runs.items()}


def table(report: dict[str, Any]) -> str:
    s = report["settings"]
    results = report["results"]
    forwarder = results["forwarder"]["cpu_ms_per_turn"]
    lines = [
        f"{s['sessions']} sessions x {s['turns']} turns, {s['rounds']} rounds; {s['cpus']} CPUs, "
        f"load {s['load_average'][0]:.1f}",
        "",
        "| server | CPU per turn | by round | above the forwarder | turns/s | p50 | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        rounds = ", ".join(f"{value:.2f}" for value in r["cpu_ms_per_turn_by_round"] if value is not None)
        above = r["cpu_ms_per_turn"] - forwarder
        lines.append(
            f"| {name} | {r['cpu_ms_per_turn']:.2f} ms | {rounds} | {above:+.2f} ms | {r['turns_per_s']:.0f} "
            f"| {r['p50_ms']:.1f} ms | {r['errors']} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=32, help="concurrent sessions per run (default 32)")
    parser.add_argument("--turns", type=int, default=20, help="turns per session (default 20)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default 4)")
    parser.add_argument("--proxy-options", default="", help="more `rollout-proxy serve` options for its column")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "bench", help="JSON (default out/bench)")
    parser.add_argument("--serve-floor", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the floor's process
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    if args.serve_floor is not None:
        serve_floor(args.serve_floor, args.engine, args.raw)
        return None
    args.out.mkdir(parents=True, exist_ok=True)
    services = Services(Path(tempfile.mkdtemp(prefix="rp-bench-", dir=args.out)))
    try:
        engine, engine_url = start_engine(services)
        targets = [
            start_floor(services, "server only", None),
            start_floor(services, "forwarder", engine_url),
            start_floor(services, "raw forwarder", engine_url, raw=True),
            start_proxy(services, "rollout-proxy", shlex.split(args.proxy_options), engine_url, "memory"),
        ]
        results = asyncio.run(run(args, targets, engine.pid))
    finally:
        services.stop()
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "serve_floor", "engine", "raw")}
    report = {"settings": settings | {"cpus": os.cpu_count(), "load_average": os.getloadavg()}, "results": results}
    (args.out / "http_floor.json").write_text(json.dumps(report, indent=1, default=str))
    print(table(report))
    print(f"wrote {args.out / 'http_floor.json'}")
    return report


if __name__ == "__main__":
    main()
