"""Chat Completions: the conversation is attached by content, then extended by a turn."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout_proxy.core.tree import ResponseTree
from rollout_proxy.core.turns import TurnResult, TurnRunner
from rollout_proxy.records import SessionRecord


class ChatService:
    def __init__(self, *, tree: ResponseTree, turns: TurnRunner) -> None:
        self._tree = tree
        self._turns = turns

    async def complete(
        self,
        session: SessionRecord,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None,
        stop: Sequence[str] = (),
    ) -> TurnResult:
        placement = await self._tree.locate(session, messages, api="chat")
        return await self._turns.generate(
            session, placement, api="chat", tools=tools if tools is not None else session.tools, stop=stop
        )
