"""Sessions: one per rollout, created by the trainer, used by one plugin call."""

from __future__ import annotations

import time
from typing import Any

from rollout_proxy.core.trajectory import Trajectory, assemble
from rollout_proxy.core.types import GenerationConfig, SessionRecord
from rollout_proxy.errors import NotFound
from rollout_proxy.ids import new_session_id, session_of_response
from rollout_proxy.proxy.engines.pool import EnginePool
from rollout_proxy.state.store import StateStore


class SessionService:
    def __init__(self, *, store: StateStore, engines: EnginePool, ttl: float) -> None:
        self._store = store
        self._engines = engines
        self._ttl = ttl

    async def create(
        self,
        *,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        extra: dict[str, Any],
        generation: GenerationConfig,
        context: dict[str, Any],
        n_sample: int | None = None,
    ) -> SessionRecord:
        now = time.time()
        session = SessionRecord(
            id=new_session_id(),
            messages=messages,
            tools=tools,
            extra=extra,
            generation=generation,
            context=context,
            created_at=now,
            expires_at=now + self._ttl,
            engine=self._engines.pick().url,
            n_sample=n_sample,
        )
        await self._store.create_session(session)
        return session

    async def get(self, session_id: str) -> SessionRecord:
        session = await self._store.get_session(session_id)
        if session is None:
            raise NotFound(f"session {session_id!r} not found (unknown or expired)", param="session_id")
        return session

    async def trajectory(self, response_id: str, *, session_id: str | None = None) -> Trajectory:
        """The trajectory ending at ``response_id``; ``session_id`` limits where to look."""
        owner = session_of_response(response_id)
        if owner is None or (session_id is not None and owner != session_id):
            raise NotFound(f"response {response_id!r} not found", param="response_id")
        session = await self.get(owner)
        path = await self._store.get_path(owner, response_id)
        if path is None:
            raise NotFound(f"response {response_id!r} not found", param="response_id")
        return assemble(owner, path, extra=_result_extra(session, response_id))

    async def latest_trajectory(self, session_id: str, api: str = "chat") -> Trajectory:
        await self.get(session_id)
        response_id = await self._store.latest(session_id, api)
        if response_id is None:
            raise NotFound(f"session {session_id!r} has no {api} response yet", param="session_id")
        return await self.trajectory(response_id, session_id=session_id)


def _result_extra(session: SessionRecord, response_id: str) -> dict[str, Any]:
    """The rollout result's ``extra`` for this response, once the session is finished."""
    result = session.result or {}
    extra = dict(result.get("extra") or {})
    for response in result.get("responses") or []:
        if response.get("id") == response_id and response.get("extra"):
            extra.update(response["extra"])
    return extra
