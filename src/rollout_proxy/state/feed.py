"""The trainer feed: graded groups, published once each, read in order.

Two implementations: ``JsonlFeed`` (a file, when running on the in-process store)
and ``redis_feed.RedisStreamFeed`` (a Redis Stream with consumer groups). Publishing
is idempotent by group id, so a runner that crashed and resumes never publishes a
group twice as new; a reader pages with a cursor (the last id it has).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Protocol

import orjson


class Feed(Protocol):
    async def publish(self, group_id: str, entry: dict[str, Any]) -> str | None:
        """Append the group; its entry id, or None if this group id was already published."""
        ...

    async def published(self, group_id: str) -> bool: ...

    async def read(self, after: str | None = None, limit: int = 100) -> list[tuple[str, dict[str, Any]]]:
        """Entries after the cursor ``after`` (an entry id), oldest first."""
        ...

    async def close(self) -> None: ...


class JsonlFeed:
    """One JSON line per group, appended and fsync'd; entry ids are line numbers from 1."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = asyncio.Lock()
        self._ids: dict[str, str] | None = None

    def _scan(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as lines:
            return [orjson.loads(line) for line in lines if line.strip()]

    async def _known(self) -> dict[str, str]:
        if self._ids is None:
            records = await asyncio.to_thread(self._scan)
            self._ids = {record["group_id"]: record["id"] for record in records}
        return self._ids

    def _append(self, line: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab") as out:
            out.write(line)
            out.flush()
            os.fsync(out.fileno())

    async def publish(self, group_id: str, entry: dict[str, Any]) -> str | None:
        async with self._lock:
            known = await self._known()
            if group_id in known:
                return None
            entry_id = str(len(known) + 1)
            record = {"id": entry_id, "group_id": group_id, "data": entry}
            await asyncio.to_thread(self._append, orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
            known[group_id] = entry_id
            return entry_id

    async def published(self, group_id: str) -> bool:
        return group_id in await self._known()

    async def read(self, after: str | None = None, limit: int = 100) -> list[tuple[str, dict[str, Any]]]:
        start = int(after or 0)
        records = await asyncio.to_thread(self._scan)
        return [(record["id"], record["data"]) for record in records[start : start + limit]]

    async def close(self) -> None:
        return None


async def open_feed(url: str, *, stream: str = "trajectories") -> Feed:
    """``jsonl:PATH`` or a ``redis://`` URL (the stream name is ``stream``)."""
    if url.startswith("jsonl:"):
        return JsonlFeed(url.removeprefix("jsonl:"))
    if url.startswith(("redis://", "rediss://", "unix://")):
        from rollout_proxy.state.redis_feed import RedisStreamFeed

        return await RedisStreamFeed.connect(url, stream=stream)
    raise ValueError(f"unknown feed {url!r}: use jsonl:PATH or redis://HOST:PORT/DB")
