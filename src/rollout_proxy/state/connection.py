"""The one way rollout-proxy opens Redis: URL check, connection, ping, retry.

The store, the trainer feed and the trainer's consumer all connect through
``connect_redis``, so they accept the same URLs (``redis://``, ``rediss://`` for TLS,
``unix://``) and wait the same way for a server that is still coming up.
"""

from __future__ import annotations

import asyncio

from redis import asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def is_redis_url(url: str) -> bool:
    return url.startswith(REDIS_SCHEMES)


async def connect_redis(url: str, *, retries: int = 5, delay: float = 0.5) -> aioredis.Redis:
    """A client of ``url`` that has answered a ping, retrying (with backoff) while the server comes up."""
    if not is_redis_url(url):
        raise ValueError(f"not a Redis URL: {url!r} (use redis://HOST:PORT/DB, rediss://... or unix://PATH)")
    client = aioredis.Redis.from_url(url, decode_responses=False)
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
