"""connect_redis: the one way Redis is opened (URL check, ping, retry while the server comes up)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from rollout_proxy.errors import StoreUnavailable
from rollout_proxy.state.connection import connect_redis, is_redis_url, shown_url
from tests.conftest import free_port


@pytest.fixture
def late_redis() -> Iterator[tuple[str, Callable[[], None]]]:
    """A URL on a free port, and a function that starts redis-server there (stopped at the end)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed; run scripts/test.sh or apt-get install redis-server")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="rp-redis-late-")
    started: list[subprocess.Popen] = []

    def start() -> None:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        started.append(
            subprocess.Popen([*args, "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )

    yield f"redis://127.0.0.1:{port}/0", start
    for process in started:
        process.terminate()
        process.wait(timeout=10)
    shutil.rmtree(workdir, ignore_errors=True)


async def test_waits_for_a_server_that_comes_up_late(late_redis):
    url, start = late_redis

    async def start_later() -> None:
        await asyncio.sleep(0.3)
        start()

    starter = asyncio.create_task(start_later())
    client = await connect_redis(url, retries=8, delay=0.05)
    try:
        await starter
        assert await client.ping()
        await client.set(b"k", b"v")
        assert await client.get(b"k") == b"v"
    finally:
        await client.aclose()


async def test_gives_up_when_nothing_listens_saying_where_and_why():
    port = free_port()
    with pytest.raises(StoreUnavailable) as raised:
        await connect_redis(f"redis://:hunter2@127.0.0.1:{port}/0", retries=2, delay=0.01)
    message = raised.value.message
    assert message.startswith(f"cannot reach Redis at redis://:***@127.0.0.1:{port}/0 (3 tries in ")
    assert "Connection refused" in message or "Connect call failed" in message
    assert "hunter2" not in message
    assert isinstance(raised.value.__cause__, RedisConnectionError | OSError)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:s3cret@host:6379/0", "redis://:***@host:6379/0"),
        ("rediss://user:s3cret@host:6380/1", "rediss://user:***@host:6380/1"),
        ("redis://user@host/0", "redis://user@host/0"),
        ("redis+cluster://:s3cret@host:7000", "redis+cluster://:***@host:7000"),
        ("redis://host/0?password=s3cret&db=2", "redis://host/0?password=***&db=2"),
        ("unix:///run/redis.sock?db=0&password=s3cret", "unix:///run/redis.sock?db=0&password=***"),
    ],
)
def test_a_url_is_shown_without_its_password(url, shown):
    assert shown_url(url) == shown


@pytest.mark.parametrize("url", ["memory", "http://127.0.0.1:6379", "127.0.0.1:6379", ""])
async def test_refuses_a_url_that_is_not_redis(url):
    with pytest.raises(ValueError, match="not a Redis URL"):
        await connect_redis(url)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://127.0.0.1:6379/0", True),
        ("rediss://cache.example:6380/1", True),
        ("unix:///run/redis.sock", True),
        ("memory", False),
        ("http://127.0.0.1:6379", False),
    ],
)
def test_is_redis_url(url, expected):
    assert is_redis_url(url) is expected
