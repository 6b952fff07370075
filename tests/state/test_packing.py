"""Commands packed by hiredis: the same bytes as redis-py's own packer, the same refusals, on every
kind of connection a URL can choose, and a real server reads them (the store's suites run on it)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import DataError

from rollout_proxy.state.connection import HiredisPacking, RedisOptions, client_for, connect_redis, packed_by_hiredis

HiredisConnection = packed_by_hiredis(Connection)
values = st.one_of(
    st.text(),
    st.binary(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
)
names = st.sampled_from(["GET", "EVALSHA", "SCRIPT LOAD", b"CLIENT SETINFO", b"HSET", "memory usage"])


def redis_py(*args: Any) -> bytes:
    return b"".join(Connection().pack_command(*args))


def hiredis_packed(*args: Any) -> bytes:
    return b"".join(HiredisConnection().pack_command(*args))


@given(names, st.lists(values, max_size=30))
def test_the_same_bytes_as_redis_py(name: str | bytes, args: list[Any]) -> None:
    assert hiredis_packed(name, *args) == redis_py(name, *args)


def test_a_large_blob_and_memory_views_pack_the_same() -> None:
    blob = bytes(range(256)) * 1024  # past redis-py's chunking cutoff
    for args in (("HSET", "k", "f", blob), ("SET", "k", memoryview(blob)), ("SET", "k", bytearray(b"ab"))):
        assert hiredis_packed(*args) == redis_py(*args)


@pytest.mark.parametrize("value", [True, None, np.int64(3), np.float32(1.5), [1]])
def test_what_redis_py_refuses_is_refused_the_same(value: Any) -> None:
    with pytest.raises(DataError):
        redis_py("SET", "k", value)
    with pytest.raises(DataError):
        hiredis_packed("SET", "k", value)


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("redis://127.0.0.1:6379/0", Connection),
        ("rediss://cache.example:6380/1", SSLConnection),
        ("unix:///run/redis.sock", UnixDomainSocketConnection),
    ],
)
def test_every_url_keeps_its_kind_of_connection(url: str, kind: type) -> None:
    pool = client_for(url, RedisOptions()).connection_pool
    assert issubclass(pool.connection_class, kind)
    assert issubclass(pool.connection_class, HiredisPacking)


async def test_a_real_server_reads_what_hiredis_packed(redis_url: str) -> None:
    client = await connect_redis(redis_url)
    try:
        assert issubclass(client.connection_pool.connection_class, HiredisPacking)
        key = "rp:test:packing"
        assert await client.set(key, "é\x00" * 3000, px=10_000)
        assert await client.get(key) == "é\x00".encode() * 3000
        assert await client.eval("return ARGV[1] .. ARGV[2]", 0, 1.5, -(2**40)) == b"1.5-1099511627776"
        assert await client.delete(key) == 1
    finally:
        await client.aclose()
