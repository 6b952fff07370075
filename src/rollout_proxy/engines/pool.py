"""Engines behind the proxy: sticky per session, least-loaded for new sessions.

Prefix caching (and, for MoE, ``routed_experts_prompt_start``) only works when all
turns of a trajectory reach the same engine, so a session is pinned to the engine
it was first given; new sessions go to the engine with the fewest requests in flight.
Each engine has a bound on requests in flight, so a burst queues here instead of
overloading one engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from rollout_proxy.engines.base import Engine


class EnginePool:
    def __init__(self, engines: Sequence[Engine], *, max_inflight: int = 256) -> None:
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self._engines = {engine.url: engine for engine in engines}
        self._inflight = dict.fromkeys(self._engines, 0)
        self._limits = {url: asyncio.Semaphore(max_inflight) for url in self._engines}

    @property
    def engines(self) -> list[Engine]:
        return list(self._engines.values())

    def pick(self) -> Engine:
        """The least-loaded engine, for a session that has none yet."""
        url = min(self._inflight, key=self._inflight.__getitem__)
        return self._engines[url]

    def get(self, url: str | None) -> Engine:
        """The session's sticky engine; a session whose engine left the pool moves to another.

        Moving is safe because prompts are sent as token ids: only the prefix cache is lost.
        """
        engine = self._engines.get(url) if url is not None else None
        return engine if engine is not None else self.pick()

    @asynccontextmanager
    async def slot(self, engine: Engine) -> AsyncIterator[Engine]:
        """Hold one of the engine's in-flight slots for the duration of a call."""
        self._inflight[engine.url] += 1
        try:
            async with self._limits[engine.url]:
                yield engine
        finally:
            self._inflight[engine.url] -= 1

    async def close(self) -> None:
        for engine in self._engines.values():
            await engine.close()
