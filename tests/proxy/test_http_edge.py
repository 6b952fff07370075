"""What aiohttp refuses before our handlers, and bodies it cannot decode: OpenAI-style JSON, never a 500.

The requests are written on raw sockets: a client library would refuse to send them.
"""

from __future__ import annotations

import asyncio
import gzip
import os
import signal
import sys
import time
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp.compression_utils import HAS_BROTLI

from tests.conftest import free_port
from tests.harness import ADMIN_KEY, ProxyHarness, store_snapshot

SESSION = orjson.dumps({"sample": {"messages": [{"role": "user", "content": "hi"}]}})
HEAD = f"POST /v1/sessions HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer {ADMIN_KEY}\r\nConnection: close\r\n"


def post(body: bytes, *headers: str) -> bytes:
    lines = "".join(f"{header}\r\n" for header in headers)
    return (HEAD + lines + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


MALFORMED = {
    "request_line_too_long": b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: proxy\r\n\r\n",
    "header_too_long": b"GET /healthz HTTP/1.1\r\nHost: proxy\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",
    "too_many_headers": b"GET /healthz HTTP/1.1\r\nHost: proxy\r\n"
    + b"".join(b"X-H%d: 1\r\n" % i for i in range(200))
    + b"\r\n",
    "bad_chunk_size": (HEAD + "Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n").encode(),
    "bad_chunk_after_data": (HEAD + "Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\nzz\r\n").encode(),
    "length_and_chunked": (
        HEAD + "Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    ).encode(),
    "two_lengths": (HEAD + "Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}").encode(),
    "bad_method": b"G@T /healthz HTTP/1.1\r\nHost: proxy\r\n\r\n",
}


async def exchange(url: str, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``raw`` bytes; the status, headers (lower-case names) and body of the answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(raw)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in header_lines:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), 5)
        return int(status_line.split()[1]), headers, body
    finally:
        writer.close()


def assert_json_error(headers: dict[str, str], body: bytes, *, code: str | None = None) -> dict:
    assert headers["content-type"].startswith("application/json"), (headers, body)
    payload = orjson.loads(body)
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["type"] == "invalid_request_error" and payload["error"]["message"]
    if code is not None:
        assert payload["error"]["code"] == code, payload
    return payload["error"]


@pytest.fixture
async def edge() -> AsyncIterator[ProxyHarness]:
    """A proxy on the in-process store whose engine is never called (creating a session does not reach it)."""
    async with ProxyHarness.running(engine_urls=["http://127.0.0.1:9"]) as harness:
        yield harness


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_malformed_http_is_a_json_400(edge, case):
    status, headers, body = await exchange(edge.url, MALFORMED[case])
    assert status == 400, body
    assert_json_error(headers, body, code="malformed_request")


async def test_a_body_that_does_not_decompress_is_a_400_not_a_500(edge):
    from rollout_proxy.proxy import keys

    before = await store_snapshot(edge.app[keys.STORE])
    status, headers, body = await exchange(edge.url, post(b"\x1f\x8bnot gzip at all", "Content-Encoding: gzip"))
    assert status == 400, body
    assert_json_error(headers, body, code="unreadable_body")
    assert await store_snapshot(edge.app[keys.STORE]) == before


async def test_a_gzipped_body_still_works(edge):
    status, _, body = await exchange(edge.url, post(gzip.compress(SESSION), "Content-Encoding: gzip"))
    assert status == 201, body


@pytest.mark.parametrize("encoding", ["x-unknown", "gzip, deflate", *([] if HAS_BROTLI else ["br"])])
async def test_an_unsupported_content_encoding_is_a_json_415(edge, encoding):
    status, headers, body = await exchange(edge.url, post(SESSION, f"Content-Encoding: {encoding}"))
    assert status == 415, body
    assert_json_error(headers, body, code="unsupported_content_encoding")


async def _wait_for_port(port: int, process: asyncio.subprocess.Process) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process.returncode is None, "rollout-proxy serve exited"
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        return
    raise AssertionError("rollout-proxy serve did not start listening")


async def test_the_serve_command_answers_malformed_http_as_json_and_stops_on_sigterm():
    port = free_port()
    env = {**os.environ, "ROLLOUT_PROXY_ADMIN_KEY": ADMIN_KEY}
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "rollout_proxy", "serve", "--port", str(port), "--engine", "http://127.0.0.1:9"),
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await _wait_for_port(port, process)
        url = f"http://127.0.0.1:{port}"
        status, headers, body = await exchange(url, MALFORMED["bad_method"])
        assert status == 400
        assert_json_error(headers, body, code="malformed_request")
        status, _, body = await exchange(url, post(SESSION))
        assert status == 201, body
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.parametrize("path", ["/v1/sessions", "/v1/chat/completions"])
async def test_a_token_that_is_not_utf8_is_a_401_not_a_500(edge, path):
    raw = f"POST {path} HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n".encode()
    raw += b"Authorization: Bearer \xe9\xff-not-utf8\r\nContent-Length: 2\r\n\r\n{}"
    status, _, body = await exchange(edge.url, raw)
    assert status == 401, body
    assert orjson.loads(body)["error"]["type"] == "authentication_error"
