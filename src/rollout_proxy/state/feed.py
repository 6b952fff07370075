"""The trainer feed: graded groups, published once each, read in order.

Two implementations: ``JsonlFeed`` (a file, when running on the in-process store)
and ``redis_feed.RedisStreamFeed`` (a Redis Stream with consumer groups). Publishing
is idempotent by group id, so a runner that crashed and resumes never publishes a
group twice as new; a reader pages with a cursor (the last entry id it has).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Protocol

import orjson

from rollout_proxy.errors import BadCursor, StoreUnavailable
from rollout_proxy.state.connection import is_redis_url
from rollout_proxy.wire.feed import FeedEntry, FeedGroup


class Feed(Protocol):
    async def publish(self, group: FeedGroup) -> str | None:
        """Append the group; its entry id, or None if this group id was already published."""
        ...

    async def published(self, group_id: str) -> bool: ...

    async def read(self, after: str | None = None, limit: int = 100) -> list[FeedEntry]:
        """Entries after the cursor ``after`` (an entry id), oldest first; ``BadCursor`` if it is not one."""
        ...

    async def close(self) -> None: ...


def bad_cursor(after: str) -> BadCursor:
    return BadCursor(f"{after!r} is not a cursor of this feed", param="after")


class JsonlFeed:
    """One JSON line per group, appended and fsync'd; entry ids are line numbers from 1."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = asyncio.Lock()
        self._ids: dict[str, str] | None = None

    def _scan(self) -> list[dict]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as lines:
            return [orjson.loads(line) for line in lines if line.strip()]

    async def _known(self) -> dict[str, str]:
        if self._ids is None:
            records = await asyncio.to_thread(self._scan)
            self._ids = {record["group_id"]: record["id"] for record in records}
        return self._ids

    def check_writable(self) -> None:
        """The file opened for appending (made, with its directory, if missing), so that a path that cannot be
        written is refused when the feed is opened, not when the first group is published."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.open("ab").close()
        except OSError as exc:
            raise StoreUnavailable(f"cannot write the feed file {str(self.path)!r}: {exc.strerror or exc}") from exc

    def _append(self, line: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab") as out:
            out.write(line)
            out.flush()
            os.fsync(out.fileno())

    async def publish(self, group: FeedGroup) -> str | None:
        async with self._lock:
            known = await self._known()
            if group.group_id in known:
                return None
            entry_id = str(len(known) + 1)
            record = {"id": entry_id, "group_id": group.group_id, "data": group.model_dump(mode="json")}
            await asyncio.to_thread(self._append, orjson.dumps(record) + b"\n")
            known[group.group_id] = entry_id
            return entry_id

    async def published(self, group_id: str) -> bool:
        return group_id in await self._known()

    async def read(self, after: str | None = None, limit: int = 100) -> list[FeedEntry]:
        try:
            start = int(after or 0)
        except ValueError:
            raise bad_cursor(str(after)) from None
        if start < 0:
            raise bad_cursor(str(after))
        records = await asyncio.to_thread(self._scan)
        return [
            FeedEntry(id=record["id"], group=FeedGroup.model_validate(record["data"]))
            for record in records[start : start + limit]
        ]

    async def close(self) -> None:
        return None


async def open_feed(url: str, *, stream: str = "trajectories") -> Feed:
    """``jsonl:PATH`` or a Redis URL (the stream name is ``stream``)."""
    if url.startswith("jsonl:"):
        feed = JsonlFeed(url.removeprefix("jsonl:"))
        await asyncio.to_thread(feed.check_writable)
        return feed
    if is_redis_url(url):
        from rollout_proxy.state.redis_feed import RedisStreamFeed

        return await RedisStreamFeed.connect(url, stream=stream)
    raise ValueError(f"unknown feed {url!r}: use jsonl:PATH or redis://HOST:PORT/DB")
