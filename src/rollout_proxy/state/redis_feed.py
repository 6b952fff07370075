"""The trainer feed on a Redis Stream, and its consumer-group reader.

Publishing is one script: the group id is checked and the entry appended together,
so a group is never added twice. Trainers read through a consumer group: what they
have not acknowledged stays pending for them (redelivered when the same consumer
comes back), and the pending entries of a consumer that stayed idle too long are
claimed by another one. Nothing is delivered to two consumers as new. Redis outages
leave every call as ``StoreUnavailable`` (see ``connection``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from redis import asyncio as aioredis
from redis.exceptions import ResponseError

from rollout_proxy.state.connection import connect_redis, translate_errors
from rollout_proxy.state.feed import bad_cursor
from rollout_proxy.state.keys import feed_published_key, feed_stream_key
from rollout_proxy.wire.feed import FeedEntry, FeedGroup

_PUBLISH = """
local existing = redis.call("HGET", KEYS[2], ARGV[1])
if existing then return {0, existing} end
local id = redis.call("XADD", KEYS[1], "*", "group_id", ARGV[1], "data", ARGV[2])
redis.call("HSET", KEYS[2], ARGV[1], id)
return {1, id}
"""


def _entries(rows: Iterable[tuple[Any, Any]]) -> list[FeedEntry]:
    """Stream rows (id, fields; bytes) as typed entries (rows of deleted entries, whose fields are gone, are skipped)."""
    return [
        FeedEntry(id=entry_id.decode(), group=FeedGroup.model_validate_json(fields[b"data"]))
        for entry_id, fields in rows
        if fields
    ]


def _read_reply(reply: object) -> list[list[Any]]:
    """An XREADGROUP reply as our clients get it (RESP2): ``[[stream, rows]]``, empty when nothing came.

    redis-py types the reply for every protocol (RESP3 answers a dict); this says which one applies.
    """
    return cast(list[list[Any]], reply)


class RedisStreamFeed:
    def __init__(self, client: aioredis.Redis, stream: str = "trajectories") -> None:
        self._redis = client
        self._keys = [feed_stream_key(stream), feed_published_key(stream)]
        self._publish = client.register_script(_PUBLISH)

    @classmethod
    async def connect(cls, url: str, *, stream: str = "trajectories") -> RedisStreamFeed:
        return cls(await connect_redis(url), stream)

    @translate_errors
    async def publish(self, group: FeedGroup) -> str | None:
        created, entry_id = await self._publish(keys=self._keys, args=[group.group_id, group.model_dump_json()])
        return entry_id.decode() if created else None

    @translate_errors
    async def published(self, group_id: str) -> bool:
        return bool(await self._redis.hexists(self._keys[1], group_id))

    @translate_errors
    async def read(self, after: str | None = None, limit: int = 100) -> list[FeedEntry]:
        low = f"({after}" if after else "-"
        try:
            rows = await self._redis.xrange(self._keys[0], min=low, max="+", count=limit)
        except ResponseError:
            raise bad_cursor(str(after)) from None
        return _entries(rows or [])  # redis-py types the reply as optional; XRANGE always answers a list

    async def close(self) -> None:
        await self._redis.aclose()


class StreamConsumer:
    """One consumer of a consumer group: pending first, then reclaimed, then new entries."""

    def __init__(self, client: aioredis.Redis, *, stream: str, group: str, consumer: str, claim_idle_ms: int) -> None:
        self._redis = client
        self._stream = feed_stream_key(stream)
        self.group, self.consumer = group, consumer
        self._claim_idle_ms = claim_idle_ms
        self._backlog_done = False

    @classmethod
    async def connect(cls, url: str, *, stream: str, group: str, consumer: str, claim_idle_ms: int) -> StreamConsumer:
        """A consumer on its own connection (closed by ``close``), its group created if missing."""
        reader = cls(
            await connect_redis(url), stream=stream, group=group, consumer=consumer, claim_idle_ms=claim_idle_ms
        )
        try:
            await reader.ensure_group()
        except BaseException:
            await reader.close()
            raise
        return reader

    async def close(self) -> None:
        await self._redis.aclose()

    @translate_errors
    async def ensure_group(self) -> None:
        try:
            await self._redis.xgroup_create(self._stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    @translate_errors
    async def fetch(self, count: int, block_ms: int) -> list[FeedEntry]:
        if not self._backlog_done:  # what this consumer was given before and never acknowledged
            rows = _read_reply(
                await self._redis.xreadgroup(self.group, self.consumer, {self._stream: "0"}, count=count)
            )
            pending = _entries(rows[0][1] if rows else [])
            if pending:
                return pending
            self._backlog_done = True
        claimed = await self._redis.xautoclaim(
            self._stream, self.group, self.consumer, min_idle_time=self._claim_idle_ms, start_id="0-0", count=count
        )
        reclaimed = _entries(claimed[1])
        if reclaimed:
            return reclaimed
        rows = _read_reply(
            await self._redis.xreadgroup(self.group, self.consumer, {self._stream: ">"}, count=count, block=block_ms)
        )
        return _entries(rows[0][1] if rows else [])

    @translate_errors
    async def ack(self, entry_id: str) -> None:
        await self._redis.xack(self._stream, self.group, entry_id)
