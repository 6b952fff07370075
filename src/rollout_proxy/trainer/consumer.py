"""``TrajectoryConsumer``: how a trainer reads graded groups from the Redis feed.

    async with TrajectoryConsumer("redis://localhost:6379/0", consumer="trainer-0") as feed:
        async for entry in feed:
            # a wire.FeedGroup: rollouts (each a trajectory and its branches), rewards, advantages
            for rollout, sequence, advantage in entry.group.sequence_advantages():
                train_on(sequence, advantage)  # every sequence of every rollout, each sampled token in one
            await feed.ack(entry)

At least once, in order: an entry stays pending for its consumer until acknowledged
(and comes back when that consumer restarts); entries left pending by a consumer idle
longer than ``claim_idle_ms`` are claimed by another one. The connection is opened on
first use (with the same retries as the proxy's own), never in the constructor.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from rollout_proxy.state.connection import is_redis_url
from rollout_proxy.state.redis_feed import StreamConsumer
from rollout_proxy.wire.feed import FeedEntry


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
        if not is_redis_url(redis_url):
            raise ValueError(f"TrajectoryConsumer reads a Redis feed; {redis_url!r} is not a Redis URL")
        self._url = redis_url
        self._stream, self._group, self._consumer = stream, group, consumer
        self._claim_idle_ms = claim_idle_ms
        self._batch, self._block_ms = batch, block_ms
        self._stop_when_idle = stop_when_idle
        self._reader: StreamConsumer | None = None

    async def __aenter__(self) -> TrajectoryConsumer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _connected(self) -> StreamConsumer:
        if self._reader is None:
            self._reader = await StreamConsumer.connect(
                self._url,
                stream=self._stream,
                group=self._group,
                consumer=self._consumer,
                claim_idle_ms=self._claim_idle_ms,
            )
        return self._reader

    async def fetch(self) -> list[FeedEntry]:
        """The next entries for this consumer (waits up to ``block_ms`` for new ones)."""
        reader = await self._connected()
        return await reader.fetch(self._batch, self._block_ms)

    async def __aiter__(self) -> AsyncIterator[FeedEntry]:
        while True:
            entries = await self.fetch()
            if not entries and self._stop_when_idle:
                return
            for entry in entries:
                yield entry

    async def ack(self, entry: FeedEntry | str) -> None:
        reader = await self._connected()
        await reader.ack(entry.id if isinstance(entry, FeedEntry) else entry)

    async def close(self) -> None:
        if self._reader is not None:
            await self._reader.close()
            self._reader = None
