"""Chat Completions: the conversation is attached by content, then extended by a turn."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from rollout_proxy.core.streaming import StreamEvent, TurnStreamer
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
        hashes: Sequence[str] | None = None,
    ) -> TurnResult:
        """``hashes``: the messages' path hashes when the caller already has them (the session read's)."""
        placement = await self._tree.locate(session, messages, api="chat", hashes=hashes)
        return await self._turns.generate(
            session, placement, api="chat", tools=tools if tools is not None else session.tools, stop=stop
        )

    async def stream(
        self,
        session: SessionRecord,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None,
        stop: Sequence[str] = (),
        hashes: Sequence[str] | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        """``complete``, streamed (``core.streaming``): the same node is recorded at the end."""
        placement = await self._tree.locate(session, messages, api="chat", hashes=hashes)
        events = TurnStreamer(self._turns).stream(
            session, placement, api="chat", tools=tools if tools is not None else session.tools, stop=stop
        )
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
