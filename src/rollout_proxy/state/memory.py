"""The in-process store: the embedded default, and the reference for the contract.

Everything lives in this object (no module-level state); expired sessions are
dropped when touched and swept at most once a minute.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rollout_proxy.errors import SessionNotFound
from rollout_proxy.records import ResponseNode, SessionRecord, SessionStatus

_SWEEP_EVERY = 60.0


@dataclass(slots=True)
class _SessionState:
    session: SessionRecord
    nodes: dict[str, ResponseNode] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)
    latest: dict[str, str] = field(default_factory=dict)


class MemoryStore:
    def __init__(self, *, clock=time.time) -> None:
        self._clock = clock
        self._sessions: dict[str, _SessionState] = {}
        self._last_sweep = clock()

    def _state(self, session_id: str) -> _SessionState | None:
        state = self._sessions.get(session_id)
        if state is not None and state.session.expires_at <= self._clock():
            del self._sessions[session_id]
            return None
        return state

    def _sweep(self) -> None:
        now = self._clock()
        if now - self._last_sweep < _SWEEP_EVERY:
            return
        self._last_sweep = now
        for session_id in [sid for sid, s in self._sessions.items() if s.session.expires_at <= now]:
            del self._sessions[session_id]

    async def create_session(self, session: SessionRecord) -> None:
        self._sweep()
        self._sessions[session.id] = _SessionState(session=session)

    async def get_session(self, session_id: str) -> SessionRecord | None:
        state = self._state(session_id)
        return None if state is None else state.session

    async def finish_session(self, session_id: str, result: dict) -> SessionRecord | None:
        state = self._state(session_id)
        if state is None or state.session.status is not SessionStatus.OPEN:
            return None
        state.session = dataclasses.replace(state.session, status=SessionStatus.FINISHED, result=result)
        return state.session

    async def put_node(
        self,
        session_id: str,
        node: ResponseNode,
        *,
        paths: Mapping[str, str],
        partial_paths: Mapping[str, str],
        latest: str | None,
    ) -> None:
        state = self._state(session_id)
        if state is None:
            raise SessionNotFound(f"session {session_id!r} not found (unknown or expired)", param="session_id")
        state.nodes[node.id] = node
        for path_hash, value in partial_paths.items():
            state.paths.setdefault(path_hash, value)
        state.paths.update(paths)
        if latest is not None:
            state.latest[latest] = state.latest["*"] = node.id

    async def get_path(self, session_id: str, node_id: str, *, routing: bool = False) -> list[ResponseNode] | None:
        state = self._state(session_id)
        if state is None or node_id not in state.nodes:
            return None
        path = []
        current: str | None = node_id
        while current is not None:
            node = state.nodes[current]
            path.append(node)
            current = node.parent_id
        path.reverse()
        return path

    async def match_paths(self, session_id: str, hashes: Sequence[str]) -> list[str | None]:
        state = self._state(session_id)
        if state is None:
            return [None] * len(hashes)
        return [state.paths.get(path_hash) for path_hash in hashes]

    async def latest(self, session_id: str, api: str) -> str | None:
        state = self._state(session_id)
        return None if state is None else state.latest.get(api)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._sessions.clear()
