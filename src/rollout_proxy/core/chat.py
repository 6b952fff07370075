"""Chat Completions: the conversation is attached by content, then extended by a turn.

The client sends the whole conversation and the policy sees it as sent: a new root whose conversation
does not hold the session's sample (or only part of it) is flagged, never given the sample
(``core.tree.place_sample``, ``insert=False``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from rollout_proxy.core.streaming import StreamEvent, TurnStreamer
from rollout_proxy.core.tree import Placement, ResponseTree, place_sample
from rollout_proxy.core.turns import TurnResult, TurnRunner
from rollout_proxy.records import SessionRecord
from rollout_proxy.state.store import SessionLease


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
        meta: dict[str, Any] | None = None,
        lease: SessionLease | None = None,
    ) -> TurnResult:
        """``hashes``: the messages' path hashes when the caller already has them (the session read's);
        ``meta``: what the node records of the request beyond its messages."""
        placement = await self._locate(session, messages, hashes, lease)
        return await self._turns.generate(
            session,
            placement,
            api="chat",
            tools=tools if tools is not None else session.tools,
            stop=stop,
            meta=meta,
            lease=lease,
        )

    async def stream(
        self,
        session: SessionRecord,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None,
        stop: Sequence[str] = (),
        hashes: Sequence[str] | None = None,
        meta: dict[str, Any] | None = None,
        lease: SessionLease | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        """``complete``, streamed (``core.streaming``): the same node is recorded at the end."""
        placement = await self._locate(session, messages, hashes, lease)
        events = TurnStreamer(self._turns).stream(
            session,
            placement,
            api="chat",
            tools=tools if tools is not None else session.tools,
            stop=stop,
            meta=meta,
            lease=lease,
        )
        async with contextlib.aclosing(events):
            async for event in events:
                yield event

    async def _locate(
        self,
        session: SessionRecord,
        messages: list[dict[str, Any]],
        hashes: Sequence[str] | None,
        lease: SessionLease | None,
    ) -> Placement:
        """The parent by content; a new root says how it holds the session's sample."""
        placement = await self._tree.locate(session, messages, api="chat", hashes=hashes, lease=lease)
        if not placement.parent:
            placement.sample = place_sample(session.messages, messages, insert=False)[1]
        return placement
