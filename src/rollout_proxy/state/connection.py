"""The one way rollout-proxy opens Redis, and the one place its failures are translated.

The store, the trainer feed and the trainer's consumer all connect through
``connect_redis``, so they accept the same URLs (``redis://``, ``rediss://`` for TLS,
``unix://``), wait the same way for a server that is still coming up, and share the
same pool settings (``RedisOptions``): socket timeouts, a PING before reusing a
connection that sat idle, and one retry of a command on a fresh connection.

That retry is redis-py's own, per command, after a connection error only (a command that
timed out may still be running on the server), and it is safe for every command we send:
reads, ``SET``, the idempotent scripts (``put_node``, the feed's publish), ``XACK``; an
``XREADGROUP`` whose reply was lost leaves its entries pending, not lost. Inside a
``WATCH`` redis-py never retries: it raises ``WatchError``, which the compare-and-set
in ``finish_session`` answers by reading again before it writes.

What is still failing after that becomes ``StoreUnavailable`` (503 with ``Retry-After``)
at the boundary (``translate_errors`` on each store and feed method); the Redis
address and the driver's message go to the log, not to the client.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import structlog
from redis import asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ClusterDownError, OutOfMemoryError, ReadOnlyError, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollout_proxy.errors import StoreUnavailable

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")

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
    """How a client talks to Redis once connected (see the module docstring)."""

    socket_timeout: float | None = 5.0  # None: wait forever (a blocking reader sets its own)
    connect_timeout: float = 2.0
    health_check_interval: int = 5  # seconds idle before a pooled connection is pinged before use
    retries: int = 1  # of a command, on a fresh connection, after a connection error


def is_redis_url(url: str) -> bool:
    return url.startswith(REDIS_SCHEMES)


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
            if is_unavailable(exc):
                raise store_unavailable(exc) from exc
            raise

    return translated


def client_for(url: str, options: RedisOptions) -> aioredis.Redis:
    backoff = ExponentialWithJitterBackoff(base=0.02, cap=0.2)
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        socket_timeout=options.socket_timeout,
        socket_connect_timeout=options.connect_timeout,
        health_check_interval=options.health_check_interval,
        # connection errors only: a timed-out command may still run on the server
        retry=Retry(backoff, options.retries, supported_errors=(RedisConnectionError,)),
    )


async def connect_redis(
    url: str, *, retries: int = 5, delay: float = 0.5, options: RedisOptions | None = None
) -> aioredis.Redis:
    """A client of ``url`` that has answered a ping, retrying (with backoff) while the server comes up."""
    if not is_redis_url(url):
        raise ValueError(f"not a Redis URL: {url!r} (use redis://HOST:PORT/DB, rediss://... or unix://PATH)")
    client = client_for(url, options or RedisOptions())
    for attempt in range(retries + 1):
        try:
            await client.ping()
            return client
        except (RedisConnectionError, RedisTimeoutError, OSError):
            if attempt == retries:
                await client.aclose()
                raise
            await asyncio.sleep(delay * (2**attempt))
    raise AssertionError("unreachable")
