"""Chat Completions on the response tree: the parent is found by content, not by id.

Chat has no ``previous_response_id``: the parent is the deepest node whose message
path is a prefix of the request's messages, found with one store read of the
rolling path hashes. When the request agrees with part of an existing node's
messages and then differs, it rewrote history: the new node forks there and records
which node it diverged from and at which message, never splicing silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog

from rollout_proxy.core.turns import TurnResult, TurnRunner
from rollout_proxy.core.types import SessionRecord
from rollout_proxy.errors import InvalidRequest
from rollout_proxy.metrics import Metrics
from rollout_proxy.state.store import StateStore
from rollout_proxy.tokenization.messages import path_hashes

log = structlog.get_logger(__name__)


def choose_parent(matches: Sequence[str | None], n_messages: int) -> tuple[str | None, int, dict[str, Any] | None]:
    """(parent id, how many request messages it covers, fork provenance or None).

    ``matches[i]`` is the path-index entry for the request's first i+1 messages:
    ``"id"`` where a node's path ends, ``"id#k"`` inside a node's messages.
    """
    parent_id, covered = None, 0
    for index, value in enumerate(matches):
        if value is not None and "#" not in value:
            parent_id, covered = value, index + 1
    for index in range(len(matches) - 1, covered - 1, -1):
        value = matches[index]
        if value is not None and "#" in value and index + 1 < n_messages:
            diverged_from = value.split("#", 1)[0]
            return parent_id, covered, {"diverged_from": diverged_from, "at_message": index + 1}
    return parent_id, covered, None


class ChatService:
    def __init__(self, *, store: StateStore, turns: TurnRunner, metrics: Metrics) -> None:
        self._store = store
        self._turns = turns
        self._metrics = metrics

    async def complete(
        self,
        session: SessionRecord,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None,
        stop: Sequence[str] = (),
    ) -> TurnResult:
        if not messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        matches = await self._store.match_paths(session.id, path_hashes(messages))
        parent_id, covered, fork = choose_parent(matches, len(messages))
        if fork is not None:
            self._metrics.inc("forks_total", api="chat")
            log.info("history_rewritten", parent_id=parent_id, **fork)
        parent = await self._turns.load_path(session.id, parent_id)
        return await self._turns.generate(
            session,
            parent,
            messages[covered:],
            api="chat",
            tools=tools if tools is not None else session.tools,
            stop=stop,
            fork=fork,
        )
