"""The state store interface, with two implementations side by side:
``memory.MemoryStore`` (in-process, the embedded default) and ``redis.RedisStore``.

Contract (tested once, over both, in tests/state/test_store_contract.py):
- a session and all its nodes expire together at ``session.expires_at``;
- ``put_node`` is atomic: the node, its parent link, its path-index entries and the
  "latest" pointer appear together or not at all;
- ``get_path`` returns root-to-leaf nodes in one round trip, whatever the depth
  (routing rows too, when asked);
- ``match_paths`` answers for many path hashes in one round trip;
- ids are looked up within the given session only: another session's id is absent;
- a write to a session that is unknown or expired raises ``SessionNotFound``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from rollout_proxy.records import ResponseNode, SessionRecord


class StateStore(Protocol):
    async def create_session(self, session: SessionRecord) -> None: ...

    async def get_session(self, session_id: str) -> SessionRecord | None: ...

    async def finish_session(self, session_id: str, result: dict) -> SessionRecord | None:
        """Atomically mark an open session finished with ``result``; None if it is not open."""
        ...

    async def put_node(
        self,
        session_id: str,
        node: ResponseNode,
        *,
        paths: Mapping[str, str],
        partial_paths: Mapping[str, str],
        latest: str | None,
    ) -> None:
        """Store a node. ``paths`` entries overwrite, ``partial_paths`` never do; the
        latest pointer is set for ``latest`` (an api name) and for ``"*"``.

        Raises ``SessionNotFound`` when the session is unknown or expired."""
        ...

    async def get_path(self, session_id: str, node_id: str, *, routing: bool = False) -> list[ResponseNode] | None:
        """Root-to-leaf nodes ending at ``node_id``; None if it is not in the session.

        MoE routing rows are loaded only when ``routing`` is set (spans always are)."""
        ...

    async def match_paths(self, session_id: str, hashes: Sequence[str]) -> list[str | None]: ...

    async def latest(self, session_id: str, api: str) -> str | None: ...

    async def ping(self) -> bool:
        """Whether the store answers now (for readiness checks); never raises."""
        ...

    async def close(self) -> None: ...
