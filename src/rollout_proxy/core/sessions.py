"""Sessions: one per rollout, created by the trainer, used by one plugin call."""

from __future__ import annotations

import time
from typing import Any

from rollout_proxy.core.trajectory import AssembledTrajectory, assemble
from rollout_proxy.engines.pool import EnginePool
from rollout_proxy.errors import Conflict, InvalidRequest, NotFound, SessionNotFound
from rollout_proxy.ids import new_session_id, session_of_response
from rollout_proxy.records import GenerationConfig, SessionRecord, SessionStatus
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
        concurrency: dict[str, Any] | None = None,
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
            concurrency=concurrency,
        )
        await self._store.create_session(session)
        return session

    async def get(self, session_id: str) -> SessionRecord:
        session = await self._store.get_session(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id!r} not found (unknown or expired)", param="session_id")
        return session

    async def get_open(self, session_id: str) -> SessionRecord:
        """The session, if it still takes requests (409 once it is finished)."""
        session = await self.get(session_id)
        if session.status is not SessionStatus.OPEN:
            raise Conflict(f"session {session_id!r} is already finished", param="session_id")
        return session

    async def trajectory(self, response_id: str, *, session_id: str | None = None) -> AssembledTrajectory:
        """The trajectory ending at ``response_id``; ``session_id`` limits where to look."""
        owner = session_of_response(response_id)
        if owner is None or (session_id is not None and owner != session_id):
            raise NotFound(f"response {response_id!r} not found", param="response_id")
        session = await self.get(owner)
        path = await self._store.get_path(owner, response_id, routing=True)
        if path is None:
            raise NotFound(f"response {response_id!r} not found", param="response_id")
        return assemble(owner, path, extra=_result_extra(session, response_id))

    async def finish(
        self,
        session_id: str,
        *,
        status: str,
        error: str | None,
        extra: dict[str, Any],
        responses: list[dict[str, Any]] | None,
        config: dict[str, Any] | None,
    ) -> tuple[SessionRecord, list[AssembledTrajectory]]:
        """Record the rollout result once and return the trajectories it names.

        Every response id must be in the session; a group session (``n_sample``) that
        succeeds must name exactly ``n_sample``. Nothing is recorded when a check fails.
        A single rollout that names none emits its latest response.
        """
        session = await self.get_open(session_id)
        if responses is None:
            latest = await self._store.latest(session_id, "*") if session.n_sample is None else None
            responses = [{"id": latest, "extra": None}] if latest is not None and status == "success" else []
        ids = [response["id"] for response in responses]
        if session.n_sample is not None and status == "success" and len(ids) != session.n_sample:
            raise InvalidRequest(
                f"a group rollout must return exactly n_sample={session.n_sample} responses, got {len(ids)}",
                param="responses",
            )
        if len(set(ids)) != len(ids):
            raise InvalidRequest("the same response id is returned twice", param="responses")
        paths = []
        for index, response_id in enumerate(ids):
            path = (
                await self._store.get_path(session_id, response_id, routing=True)
                if session_of_response(response_id) == session_id
                else None
            )
            if path is None:
                raise InvalidRequest(
                    f"response {response_id!r} is not in session {session_id!r}", param=f"responses[{index}].id"
                )
            paths.append(path)
        result = {"status": status, "error": error, "extra": extra, "responses": responses, "config": config}
        finished = await self._store.finish_session(session_id, result)
        if finished is None:
            raise Conflict(f"session {session_id!r} is already finished", param="session_id")
        trajectories = [
            assemble(session_id, path, extra=_result_extra(finished, response_id))
            for response_id, path in zip(ids, paths, strict=True)
        ]
        return finished, trajectories

    async def latest_trajectory(self, session_id: str, api: str = "chat") -> AssembledTrajectory:
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
