"""The Anthropic Messages API on the response tree: the conversation attached by content, as Chat
Completions are, then extended by a turn.

The client sends the whole conversation (``system`` first, then its messages) and the policy sees it as
sent: a new root whose conversation does not hold the session's sample, or only part of it, is flagged,
never given the sample (``core.tree.place_sample``, ``insert=False``).

A ``thinking`` block the proxy answered carries a signature naming its node (``proxy.anthropic_answers``).
Content alone cannot tell apart two siblings that differ only in their reasoning (a group's samples that
reach the same answer by different thoughts: the path index names the last one written), so when the
conversation's last covered assistant message is signed by another node of the same content, that node is
the parent: the trajectory goes on from the tokens this client was answered.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import numpy as np
import structlog

from rollout_proxy.core.streaming import StreamEvent, TurnStreamer
from rollout_proxy.core.tree import Placement, ResponseTree, place_sample
from rollout_proxy.core.turns import TurnResult, TurnRunner
from rollout_proxy.records import SessionRecord

log = structlog.get_logger(__name__)

#: the API name nodes and metrics carry
API = "messages"


class MessagesService:
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
        signed: Sequence[tuple[int, str]] = (),
        meta: dict[str, Any] | None = None,
    ) -> TurnResult:
        """``hashes``: the messages' path hashes (computed with the session read); ``signed``: (message index,
        node id) of the assistant messages whose thinking the proxy signed; ``meta``: what the node records of
        the request beyond its messages."""
        placement = await self.locate(session, messages, hashes=hashes, signed=signed)
        return await self._turns.generate(
            session, placement, api=API, tools=tools if tools is not None else session.tools, stop=stop, meta=meta
        )

    async def stream(
        self,
        session: SessionRecord,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None,
        stop: Sequence[str] = (),
        hashes: Sequence[str] | None = None,
        signed: Sequence[tuple[int, str]] = (),
        meta: dict[str, Any] | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        """``complete``, streamed (``core.streaming``): the same node is recorded at the end."""
        placement = await self.locate(session, messages, hashes=hashes, signed=signed)
        events = TurnStreamer(self._turns).stream(
            session, placement, api=API, tools=tools if tools is not None else session.tools, stop=stop, meta=meta
        )
        async with contextlib.aclosing(events):
            async for event in events:
                yield event

    async def count_tokens(
        self,
        session: SessionRecord,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None,
        hashes: Sequence[str] | None = None,
        signed: Sequence[tuple[int, str]] = (),
    ) -> int:
        """How many tokens the prompt of a turn on this conversation has: the parent's exact tokens and the
        bridge for the rest, rendered by the policy's template; nothing is stored."""
        placement = await self.locate(session, messages, hashes=hashes, signed=signed)
        prompt: np.ndarray = await self._turns.prompt_tokens(
            session, placement, tools=tools if tools is not None else session.tools
        )
        return len(prompt)

    async def locate(
        self,
        session: SessionRecord,
        messages: list[dict[str, Any]],
        *,
        hashes: Sequence[str] | None,
        signed: Sequence[tuple[int, str]],
    ) -> Placement:
        """The parent by content, or by the signature of the last assistant message it covers (module
        docstring); a new root says how it holds the session's sample."""
        placement = await self._tree.locate(session, messages, api=API, hashes=hashes)
        covered = len(messages) - len(placement.new_messages)
        named = dict(signed)
        last = covered - 1
        if placement.parent and last in named and placement.parent[-1].id != named[last]:
            path = await self._tree.path(session.id, named[last], param="messages")
            if path[-1].path_hash == placement.parent[-1].path_hash:  # the same conversation: only tokens differ
                log.info("parent_by_signature", parent_id=path[-1].id, by_content=placement.parent[-1].id)
                self._turns.metrics.inc("parents_by_signature_total", api=API)
                placement = Placement(
                    parent=path,
                    new_messages=placement.new_messages,
                    new_hashes=placement.new_hashes,
                    fork=placement.fork,
                )
        if not placement.parent:
            placement.sample = place_sample(session.messages, messages, insert=False)[1]
        return placement
