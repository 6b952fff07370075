"""Outages answered honestly: Redis down or hung is a 503 with Retry-After (never a 500), and
the proxy heals by itself once it is back; an engine that takes a completion and never answers
it is a 504 within the configured timeouts, one that answers nothing at all (not even its
health probe) gets no turn (503 at once), and /readyz answers within a second whatever the
engines do.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import openai
import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.proxy import keys
from tests.conftest import free_port
from tests.harness import ADMIN_KEY, ProxyHarness

USER = [{"role": "user", "content": "Tell me a story."}]
#: After Redis answers PING again, this long for the proxy to be whole (its pooled connections heal).
SETTLE_S = 0.5


class RedisServer:
    """A redis-server of our own (AOF on) that a test can kill -9, restart on the same port and dir, or freeze."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed; run scripts/test.sh or apt-get install redis-server")
        self.binary = binary
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="rp-redis-outage-")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir, "--save", ""]
        self.process = subprocess.Popen(
            [self.binary, *args, "--appendonly", "yes"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.wait_for_pong()

    def wait_for_pong(self, timeout: float = 15) -> float:
        """Block until the server answers PING with PONG (not LOADING); the time it did."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(64).startswith(b"+PONG"):
                        return time.monotonic()
            except OSError:
                pass
            time.sleep(0.01)
        raise AssertionError("redis-server did not come up")

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def freeze(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.thaw()
            self.process.terminate()
            self.process.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def engine(tokenizer_dir: Path) -> AsyncIterator[FakeEngine]:
    fake = FakeEngine(tokenizer_dir, delay=0.005)
    async with FakeEngineServer(fake) as url:
        fake.url = url  # type: ignore[attr-defined]
        yield fake


async def until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition`` (checked every 20 ms), failing after 15 seconds."""
    async with asyncio.timeout(15):
        while not condition():  # noqa: ASYNC110 (a count many tasks update; polling is simplest)
            await asyncio.sleep(0.02)


@dataclass
class Answer:
    at: float  # when the answer arrived (time.monotonic)
    status: int
    retry_after: str | None = None
    body: object = None


@dataclass
class Worker:
    """One plugin: sessions of turns, each extending the last answered one; what is refused is tried again."""

    proxy: ProxyHarness
    http: aiohttp.ClientSession
    answers: list[Answer] = field(default_factory=list)
    #: per session: the response ids answered 200, in order
    chains: dict[str, list[str]] = field(default_factory=dict)

    async def new_session(self) -> openai.AsyncOpenAI | None:
        body = {"sample": {"messages": USER}, "generation": {"max_new_tokens": 8}}
        async with self.http.post(
            self.proxy.url + "/v1/sessions", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        ) as response:
            payload = await response.json()
            self.answers.append(Answer(time.monotonic(), response.status, response.headers.get("Retry-After"), payload))
        if response.status != 201:
            return None
        self.chains[payload["session_id"]] = []
        return self.proxy.client(payload["base_url"], payload["api_key"])

    async def run(self, stop: asyncio.Event, turns_per_session: int = 4) -> None:
        while not stop.is_set():
            client = await self.new_session()
            if client is None:
                await asyncio.sleep(0.02)
                continue
            chain = list(self.chains.values())[-1]
            history = list(USER)
            while len(chain) < turns_per_session and not stop.is_set():
                try:
                    reply = await client.chat.completions.create(model="m", messages=history)
                except openai.APIStatusError as exc:
                    headers = exc.response.headers
                    self.answers.append(Answer(time.monotonic(), exc.status_code, headers.get("Retry-After"), exc.body))
                    await asyncio.sleep(0.02)
                    continue
                self.answers.append(Answer(time.monotonic(), 200))
                chain.append(reply.id)
                history = [*history, reply.choices[0].message.model_dump(exclude_none=True)]
                history.append({"role": "user", "content": f"And then? ({len(chain)})"})


async def test_a_redis_restart_under_load_is_503s_while_down_and_loses_no_answered_turn(own_redis, engine):
    async with ProxyHarness.running(engine_urls=[engine.url], store_url=own_redis.url) as proxy:
        http = aiohttp.ClientSession()
        workers = [Worker(proxy, http) for _ in range(16)]
        stop = asyncio.Event()
        tasks = [asyncio.create_task(worker.run(stop)) for worker in workers]

        def seen(ok: bool) -> int:
            return sum((answer.status < 300) == ok for worker in workers for answer in worker.answers)

        try:
            await until(lambda: seen(ok=True) >= 16)  # turns are being answered
            killed_at = time.monotonic()
            await asyncio.to_thread(own_redis.kill)
            await until(lambda: seen(ok=False) >= 16)  # down, and requests meet it
            await asyncio.to_thread(own_redis.start)  # same port, same dir: it reloads its AOF
            back_at = await asyncio.to_thread(own_redis.wait_for_pong)
            answered = seen(ok=True)
            await asyncio.sleep(SETTLE_S)
            await until(lambda: seen(ok=True) >= answered + 32)  # back: every request must succeed after the settle
        finally:
            stop.set()
            await asyncio.gather(*tasks)
            await http.close()

        answers = [answer for worker in workers for answer in worker.answers]
        assert {answer.status for answer in answers} <= {200, 201, 503}, sorted({a.status for a in answers})
        refused = [answer for answer in answers if answer.status == 503]
        for answer in refused:
            assert answer.retry_after is not None and int(answer.retry_after) >= 1
            assert isinstance(answer.body, dict) and answer.body["type"] == "service_unavailable"
            assert killed_at <= answer.at <= back_at + SETTLE_S, (answer.at - back_at, answer)
        assert any(answer.status == 200 and answer.at > back_at + SETTLE_S for answer in answers)

        for worker in workers:
            for chain in worker.chains.values():
                for turn, response_id in enumerate(chain, start=1):
                    trajectory = await proxy.trajectory(response_id)
                    assert trajectory["turns"] == turn, (response_id, trajectory["turns"], turn)


async def test_a_hung_redis_is_a_503_in_time_and_readyz_still_answers(own_redis, engine):
    async with ProxyHarness.running(
        engine_urls=[engine.url], store_url=own_redis.url, redis_socket_timeout=0.5
    ) as proxy:
        session = await proxy.create_session(USER, max_new_tokens=8)
        await session.client.chat.completions.create(model="m", messages=USER)
        own_redis.freeze()
        try:
            started = time.monotonic()
            with pytest.raises(openai.APIStatusError) as raised:
                await session.client.chat.completions.create(model="m", messages=USER)
            assert raised.value.status_code == 503 and raised.value.response.headers["Retry-After"]
            assert time.monotonic() - started < 30  # the socket timeout (0.5 s) and its retry, not a hang
            status, body = await proxy.request("GET", "/readyz", token=None)
            assert status == 503 and body["store"] is False
        finally:
            own_redis.thaw()
        again = await session.client.chat.completions.create(model="m", messages=USER)
        assert again.id


@pytest.fixture
async def hung_engine() -> AsyncIterator[str]:
    """A server that accepts connections and reads, and never answers."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    for writer in held:
        writer.close()
    server.close()


@pytest.mark.parametrize(
    "timeouts, deadline",
    [
        ({"engine_first_byte_timeout": 0.5, "engine_timeout": 60.0}, 0.5),
        ({"engine_first_byte_timeout": 60.0, "engine_timeout": 0.7}, 0.7),
    ],
    ids=["first-byte", "total"],
)
async def test_a_hung_completion_is_a_504_within_the_deadline(engine, timeouts, deadline):
    """The engine passes its health probes but never answers the completion (fault "hang")."""
    async with ProxyHarness.running(engine_urls=[engine.url], **timeouts) as proxy:
        session = await proxy.create_session(USER, max_new_tokens=8)
        engine.set_fault("hang")
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as raised:
            await session.client.chat.completions.create(model="m", messages=USER)
        elapsed = time.monotonic() - started
        assert raised.value.status_code == 504, raised.value.body
        assert raised.value.body["type"] == "timeout" and raised.value.body["code"] == "engine_timeout"
        assert raised.value.response.headers["Retry-After"]
        assert deadline <= elapsed < 30, elapsed  # this deadline, not the other timeout (60 s)
        assert engine.url.removeprefix("http://") not in raised.value.body["message"]


async def test_an_engine_that_answers_nothing_gets_no_turn_and_the_proxy_is_not_ready(hung_engine):
    async with ProxyHarness.running(engine_urls=[hung_engine]) as proxy:
        session = await proxy.create_session(USER, max_new_tokens=8)
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as raised:
            await session.client.chat.completions.create(model="m", messages=USER)
        assert time.monotonic() - started < 30  # not routed at all: no first-byte timeout (600 s) to wait out
        assert raised.value.status_code == 503 and raised.value.body["code"] == "engine_unavailable"
        assert raised.value.response.headers["Retry-After"]
        assert hung_engine.removeprefix("http://") not in raised.value.body["message"]
        status, body = await proxy.request("GET", "/readyz", token=None)
        assert status == 503 and body["engines"] == {"healthy": 0, "total": 1}


async def test_readyz_answers_without_waiting_on_a_probe_whatever_the_engines_do(hung_engine, engine):
    async with ProxyHarness.running(engine_urls=[hung_engine, engine.url, f"http://127.0.0.1:{free_port()}"]) as proxy:
        probe = proxy.app[keys.ENGINES].settings.health_timeout  # what waiting on the hung engine's probe costs
        for _ in range(2):
            started = time.monotonic()
            status, body = await proxy.request("GET", "/readyz", token=None)
            assert time.monotonic() - started < probe
            assert status == 200 and body == {"ready": True, "store": True, "engines": {"healthy": 1, "total": 3}}


@pytest.fixture
async def resetting_engine() -> AsyncIterator[str]:
    """A server that accepts a connection and drops it at once."""

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    server.close()


async def test_a_reset_connection_is_a_503(resetting_engine):
    async with ProxyHarness.running(engine_urls=[resetting_engine]) as proxy:
        session = await proxy.create_session(USER, max_new_tokens=8)
        with pytest.raises(openai.APIStatusError) as raised:
            await session.client.chat.completions.create(model="m", messages=USER)
        assert raised.value.status_code == 503 and raised.value.body["type"] == "service_unavailable"
        assert raised.value.response.headers["Retry-After"]
        assert resetting_engine.removeprefix("http://") not in raised.value.body["message"]


def test_the_timeouts_come_from_flags_and_the_environment(settings_environ):
    from rollout_proxy.app import engine_client, fleet_settings, redis_options
    from rollout_proxy.cli import build_parser
    from rollout_proxy.settings import Settings

    settings_environ.setenv("ROLLOUT_PROXY_ENGINE_FIRST_BYTE_TIMEOUT", "42.5")
    settings_environ.setenv("ROLLOUT_PROXY_REDIS_RETRIES", "3")
    args = build_parser().parse_args(["serve", "--engine-connect-timeout", "1.5", "--redis-socket-timeout", "0.25"])
    settings = Settings.from_env(
        engine_connect_timeout=args.engine_connect_timeout, redis_socket_timeout=args.redis_socket_timeout
    )
    client = engine_client("http://engine:8000", settings)
    assert (client._timeout.sock_connect, client._timeout.sock_read, client._timeout.total) == (1.5, 42.5, 600.0)
    assert fleet_settings(settings).call_timeout == 42.5  # a completion's first byte is its last
    options = redis_options(settings)
    assert (options.socket_timeout, options.retries, options.health_check_interval) == (0.25, 3, 5)
