"""The one way rollout-proxy opens Redis, and the one place its failures are translated.

The store, the trainer feed and the trainer's consumer all connect through
``connect_redis``, so they accept the same URLs (``redis://``, ``rediss://`` for TLS,
``unix://``, ``redis+cluster://``), wait the same way for a server that is still coming up, and share the
same pool settings (``RedisOptions``): socket timeouts, a PING before reusing a
connection that sat idle, and one retry of a command on a fresh connection.

That retry is redis-py's own, per command, after a connection error only (a command that
timed out may still be running on the server), and it is safe for every command we send:
reads, ``SET``, the idempotent scripts (``put_node``, the feed's publish), ``XACK``; an
``XREADGROUP`` whose reply was lost leaves its entries pending, not lost. Inside a
``WATCH`` redis-py never retries: it raises ``WatchError``, which the compare-and-set
in ``finish_session`` answers by reading again before it writes.

The pool is a ``BlockingConnectionPool`` of ``max_connections``: a command that finds every
connection busy waits up to ``pool_timeout`` for one, then fails as ``StoreBusy`` (503 with
``Retry-After``), never as redis-py's ``MaxConnectionsError`` (a 500). A Redis Cluster
(``redis+cluster://HOST:PORT``) gets redis-py's ``RedisCluster``, whose per-node pools fail at once
when full: ``ConnectionGate`` is the same bounded wait, kept by the store.

Commands are packed by hiredis (``packed_by_hiredis``), as redis-py's synchronous client does;
its asyncio connections pack in Python, ~5x slower for a turn's script calls (docs/benchmarks: redis_packing). Not on a cluster,
whose node connections redis-py builds itself.

What is still failing after that becomes ``StoreUnavailable`` (503 with ``Retry-After``)
at the boundary (``translate_errors`` on each store and feed method); the Redis
address and the driver's message go to the log, not to the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import urllib.parse
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, cast

import hiredis
import structlog
from redis import asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import (
    ClusterDownError,
    MaxConnectionsError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollout_proxy.errors import StoreBusy, StoreUnavailable
from rollout_proxy.settings import from_setting

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
#: A Redis Cluster: ``redis+cluster://HOST:PORT`` (any one node; the client learns the rest), or
#: ``rediss+cluster://`` for TLS.
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")

#: Failures that say "the store cannot answer now", not "this request is wrong". ConnectionError
#: covers BusyLoadingError (the server is loading its AOF after a restart); ReadOnlyError is a
#: replica during failover; MISCONF (a failed save refusing writes) comes as a bare ResponseError.
UNAVAILABLE: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ReadOnlyError,
    OutOfMemoryError,
    ClusterDownError,
    TryAgainError,
    OSError,
)

log = structlog.get_logger(__name__)

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RedisOptions:
    """How a client talks to Redis once connected (see the module docstring), and how the store packs nodes."""

    socket_timeout: float | None = from_setting("redis_socket_timeout")  # None: wait forever (a blocking reader)
    connect_timeout: float = from_setting("redis_connect_timeout")
    health_check_interval: int = from_setting("redis_health_check_interval")
    retries: int = from_setting("redis_retries")
    max_connections: int = from_setting("redis_max_connections")  # per cluster node on a cluster
    pool_timeout: float = from_setting("redis_pool_timeout")  # then StoreBusy
    node_compression: int = from_setting("redis_node_compression")  # the store's node blobs (state/codec.py)


def is_pool_exhausted(exc: BaseException) -> bool:
    """Every pooled connection stayed busy: the blocking pool's timeout, or a cluster node's full pool."""
    return isinstance(exc, MaxConnectionsError) or (
        isinstance(exc, RedisConnectionError) and str(exc) == "No connection available."
    )


def is_redis_url(url: str) -> bool:
    return url.startswith(REDIS_SCHEMES) or is_cluster_url(url)


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEMES)


def shown_url(url: str) -> str:
    """``url`` as it may be printed or logged: a password in it (``redis://:secret@host``, ``?password=``)
    masked."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None and "password=" not in parts.query:
        return url
    if parts.password is not None:
        user = f"{parts.username}:" if parts.username else ":"
        parts = parts._replace(netloc=f"{user}***@{parts.netloc.rpartition('@')[2]}")
    if "password=" in parts.query:
        pairs = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        shown = [(name, "***" if name == "password" else value) for name, value in pairs]
        parts = parts._replace(query=urllib.parse.urlencode(shown, safe="*"))
    query = f"?{parts.query}" if parts.query else ""
    return f"{parts.scheme}://{parts.netloc}{parts.path}{query}"


def is_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, UNAVAILABLE) or (isinstance(exc, ResponseError) and str(exc).startswith("MISCONF"))


def store_unavailable(exc: BaseException) -> StoreUnavailable:
    log.warning("store_unavailable", error=f"{type(exc).__name__}: {exc}")
    return StoreUnavailable("the state store is unavailable right now; try again shortly")


def translate_errors(call: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """Wrap a store method: Redis outages leave it as ``StoreUnavailable``, nothing else changes."""

    @functools.wraps(call)
    async def translated(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await call(*args, **kwargs)
        except Exception as exc:
            if is_pool_exhausted(exc):
                log.warning("store_pool_exhausted", error=f"{type(exc).__name__}: {exc}")
                raise StoreBusy("the proxy's connections to the state store are all busy; try again shortly") from exc
            if is_unavailable(exc):
                raise store_unavailable(exc) from exc
            raise

    return translated


class ConnectionGate:
    """A bounded wait for one of ``size`` connections, for a client whose pool does not wait itself
    (redis-py's cluster pools fail at once when full): ``StoreBusy`` once ``timeout`` runs out."""

    def __init__(self, size: int, timeout: float) -> None:
        self._free = asyncio.Semaphore(size)
        self._timeout = timeout

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self._timeout):
                await self._free.acquire()
        except TimeoutError:
            log.warning("store_pool_exhausted", waited=self._timeout)
            raise StoreBusy("the proxy's connections to the state store are all busy; try again shortly") from None
        try:
            yield
        finally:
            self._free.release()


class HiredisPacking:
    """A connection mixin: ``pack_command`` by ``hiredis.pack_command`` (one C call for the whole
    command). Same bytes as redis-py's packer for what hiredis takes (str as UTF-8, bytes, int,
    float as ``repr``); anything else (bool, None, a bytearray, numpy scalars) goes to redis-py's
    own packer, so it is packed or refused exactly as before."""

    def pack_command(self, *args: Any) -> list[bytes]:
        name = args[0]  # "SCRIPT LOAD": the server wants the words apart, as redis-py sends them
        if isinstance(name, str) and " " in name:
            args = (*name.encode().split(), *args[1:])
        elif isinstance(name, bytes) and b" " in name:
            args = (*name.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:
            return cast(list[bytes], super().pack_command(*args))  # type: ignore[misc]


def packed_by_hiredis(connection_class: type[Any]) -> type[Any]:
    """``connection_class`` (plain, TLS or Unix socket, as the URL chose) with ``HiredisPacking``."""
    return type(f"Hiredis{connection_class.__name__}", (HiredisPacking, connection_class), {})


def client_for(url: str, options: RedisOptions) -> aioredis.Redis:
    """A client over a blocking pool: a command that finds every connection busy waits (bounded) for one."""
    backoff = ExponentialWithJitterBackoff(base=0.02, cap=0.2)
    if is_cluster_url(url):
        return cast(aioredis.Redis, cluster_client(url, options))
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=options.max_connections,
        timeout=options.pool_timeout,
        decode_responses=False,
        socket_timeout=options.socket_timeout,
        socket_connect_timeout=options.connect_timeout,
        health_check_interval=options.health_check_interval,
        # connection errors only: a timed-out command may still run on the server
        retry=Retry(backoff, options.retries, supported_errors=(RedisConnectionError,)),
    )
    pool.connection_class = packed_by_hiredis(pool.connection_class)
    return aioredis.Redis.from_pool(pool)


def cluster_client(url: str, options: RedisOptions) -> RedisCluster:
    """A Redis Cluster client (it learns the slots from the node in ``url``). redis-py's cluster pools do
    not wait for a free connection; ``RedisStore`` bounds its own concurrency to the pool instead."""
    plain = url.replace("+cluster", "", 1)
    return RedisCluster.from_url(
        plain,
        decode_responses=False,
        socket_timeout=options.socket_timeout,
        socket_connect_timeout=options.connect_timeout,
        health_check_interval=options.health_check_interval,
        max_connections=options.max_connections,
    )


async def connect_redis(
    url: str, *, retries: int = 5, delay: float = 0.5, options: RedisOptions | None = None
) -> aioredis.Redis:
    """A client of ``url`` that has answered a ping, retrying (with backoff) while the server comes up;
    ``StoreUnavailable``, saying where and why, once it has tried ``retries`` times more."""
    if not is_redis_url(url):
        raise ValueError(
            f"not a Redis URL: {url!r} (use redis://HOST:PORT/DB, rediss://..., unix://PATH or redis+cluster://HOST:PORT)"
        )
    client = client_for(url, options or RedisOptions())
    started = asyncio.get_running_loop().time()
    for attempt in range(retries + 1):
        try:
            await client.ping()
            return client
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            if attempt == retries:
                await client.aclose()
                waited = asyncio.get_running_loop().time() - started
                raise StoreUnavailable(
                    f"cannot reach Redis at {shown_url(url)} ({attempt + 1} tries in {waited:.1f} s): "
                    f"{str(exc).rstrip('.')}; is redis-server running there?"
                ) from exc
            wait = delay * (2**attempt)
            log.warning(
                "redis_waiting", url=shown_url(url), tried=attempt + 1, of=retries + 1, again_in_s=wait, error=str(exc)
            )
            await asyncio.sleep(wait)
    raise AssertionError("unreachable")
