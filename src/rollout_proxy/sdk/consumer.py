"""``TrajectoryConsumer``: how a trainer reads graded groups from the Redis feed.

    async with TrajectoryConsumer("redis://localhost:6379/0", consumer="trainer-0") as feed:
        async for entry in feed:
            train_on(entry.data)
            await feed.ack(entry)

At least once, in order: an entry stays pending for its consumer until acknowledged
(and comes back when that consumer restarts); entries left pending by a consumer idle
longer than ``claim_idle_ms`` are claimed by another one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from redis import asyncio as aioredis

from rollout_proxy.state.redis_feed import StreamConsumer


@dataclass(frozen=True, slots=True)
class FeedEntry:
    id: str
    data: dict[str, Any]

    @property
    def group_id(self) -> str | None:
        return self.data.get("group_id")


class TrajectoryConsumer:
    def __init__(
        self,
        redis_url: str,
        *,
        stream: str = "trajectories",
        group: str = "trainer",
        consumer: str = "trainer-0",
        batch: int = 16,
        block_ms: int = 1000,
        claim_idle_ms: int = 60_000,
        stop_when_idle: bool = False,
    ) -> None:
        self._client = aioredis.Redis.from_url(redis_url, decode_responses=False)
        self._reader = StreamConsumer(
            self._client, stream=stream, group=group, consumer=consumer, claim_idle_ms=claim_idle_ms
        )
        self._batch, self._block_ms = batch, block_ms
        self._stop_when_idle = stop_when_idle
        self._ready = False

    async def __aenter__(self) -> TrajectoryConsumer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def fetch(self) -> list[FeedEntry]:
        """The next entries for this consumer (waits up to ``block_ms`` for new ones)."""
        if not self._ready:
            await self._reader.ensure_group()
            self._ready = True
        return [FeedEntry(entry_id, data) for entry_id, data in await self._reader.fetch(self._batch, self._block_ms)]

    async def __aiter__(self) -> AsyncIterator[FeedEntry]:
        while True:
            entries = await self.fetch()
            if not entries and self._stop_when_idle:
                return
            for entry in entries:
                yield entry

    async def ack(self, entry: FeedEntry | str) -> None:
        await self._reader.ack(entry.id if isinstance(entry, FeedEntry) else entry)

    async def close(self) -> None:
        await self._client.aclose()
