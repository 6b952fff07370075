"""The Anthropic Messages API on the response tree: the conversation attached by content, as Chat
Completions are, then extended by a turn.

The client sends the whole conversation (``system`` first, then its messages), or, on a server-held thread
(``thread: {"type": "continue", "previous_message_id"}``, the anthropic SDK's tool runner), only the new
turn's messages after the message it names, as ``previous_response_id`` does. The policy sees it as sent: a new root whose conversation does not hold the session's sample, or only part of it, is flagged,
never given the sample (``core.tree.place_sample``, ``insert=False``).

A ``thinking`` block the proxy answered carries a signature naming its node (``proxy.anthropic_answers``).
Content alone cannot tell apart two siblings that differ only in their reasoning (a group's samples that
reach the same answer by different thoughts), so the signed blocks the conversation echoes name their
nodes to the tree (``core.tree``: with the proxy's ``tool_use`` ids and the reasoning, what tells siblings
apart), and a covered assistant message signed by another node of the same content makes that node the
parent: the trajectory goes on from the tokens this client was answered.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from rollout_proxy.core.streaming import StreamEvent, TurnStreamer
from rollout_proxy.core.tree import Placement, ResponseTree, place_sample
from rollout_proxy.core.turns import TurnResult, TurnRunner
from rollout_proxy.errors import InvalidRequest, NotFound
from rollout_proxy.records import SessionRecord
from rollout_proxy.state.store import SessionLease

log = structlog.get_logger(__name__)

#: the API name nodes and metrics carry
API = "messages"
#: where a thread's turn records the tools it rendered (``meta``), for the turns that continue it without them
THREAD_TOOLS = "thread_tools"


@dataclass(frozen=True, slots=True)
class Thread:
    """A turn on a server-held thread (Anthropic's ``thread: {"type": "continue"}``): the message it continues
    from, and the ``system`` it sent, if any."""

    previous_message_id: str
    system: str | None = None


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
        thread: Thread | None = None,
        meta: dict[str, Any] | None = None,
        lease: SessionLease | None = None,
    ) -> TurnResult:
        """``hashes``: the messages' path hashes (computed with the session read); ``signed``: (message index,
        node id) of the assistant messages whose thinking the proxy signed; ``meta``: what the node records of
        the request beyond its messages; ``thread``: the message a server-held thread continues from."""
        placement = await self.locate(session, messages, hashes=hashes, signed=signed, thread=thread, lease=lease)
        tools = self._tools(session, placement, tools, thread)
        return await self._turns.generate(session, placement, api=API, tools=tools, stop=stop, meta=meta, lease=lease)

    async def stream(
        self,
        session: SessionRecord,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None,
        stop: Sequence[str] = (),
        hashes: Sequence[str] | None = None,
        signed: Sequence[tuple[int, str]] = (),
        thread: Thread | None = None,
        meta: dict[str, Any] | None = None,
        lease: SessionLease | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        """``complete``, streamed (``core.streaming``): the same node is recorded at the end."""
        placement = await self.locate(session, messages, hashes=hashes, signed=signed, thread=thread, lease=lease)
        tools = self._tools(session, placement, tools, thread)
        events = TurnStreamer(self._turns).stream(
            session, placement, api=API, tools=tools, stop=stop, meta=meta, lease=lease
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
        lease: SessionLease | None = None,
    ) -> int:
        """How many tokens the prompt of a turn on this conversation has: the parent's exact tokens and the
        bridge for the rest, rendered by the policy's template; nothing is stored."""
        placement = await self.locate(session, messages, hashes=hashes, signed=signed, lease=lease)
        prompt: np.ndarray = await self._turns.prompt_tokens(
            session, placement, tools=self._tools(session, placement, tools, None)
        )
        return len(prompt)

    async def locate(
        self,
        session: SessionRecord,
        messages: list[dict[str, Any]],
        *,
        hashes: Sequence[str] | None,
        signed: Sequence[tuple[int, str]],
        thread: Thread | None = None,
        lease: SessionLease | None = None,
    ) -> Placement:
        """The parent by content, or by the signature of the last assistant message it covers (module
        docstring), or the message a thread continues from; a new root says how it holds the session's
        sample."""
        if thread is not None:
            return await self._continue(session, messages, thread, lease)
        named = dict(signed)
        placement = await self._tree.locate(session, messages, api=API, hashes=hashes, named=named, lease=lease)
        covered = len(messages) - len(placement.new_messages)
        last = covered - 1
        if placement.parent and last in named and placement.parent[-1].id != named[last]:
            path = await self._tree.path(session.id, named[last], param="messages", lease=lease)
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

    async def _continue(
        self, session: SessionRecord, messages: list[dict[str, Any]], thread: Thread, lease: SessionLease | None
    ) -> Placement:
        """The thread's next turn: the new messages after the node ``thread`` names (an echo of its output
        dropped); a ``system`` sent again must be the one the thread started with (the policy saw it)."""
        try:
            placement = await self._tree.after(session, thread.previous_message_id, messages, lease=lease)
        except NotFound:
            raise NotFound(
                f"message {thread.previous_message_id!r} not found in this session", param="thread.previous_message_id"
            ) from None
        first = placement.parent[0].messages[0]
        started = first["content"] if first["role"] == "system" else None
        if thread.system is not None and thread.system != started:
            raise InvalidRequest(
                "system differs from the one this thread started with; the policy already saw that one, so it "
                "cannot change inside a thread (send it unchanged, or leave it out)",
                param="system",
            )
        return placement

    @staticmethod
    def _tools(
        session: SessionRecord, placement: Placement, tools: list[dict[str, Any]] | None, thread: Thread | None
    ) -> list[dict[str, Any]] | None:
        """The turn's tools: the request's, else (continuing a thread) the ones its last turn that sent tools
        recorded (``THREAD_TOOLS``), else the session's."""
        if tools is not None:
            return tools
        if thread is not None:
            for node in reversed(placement.parent):
                if THREAD_TOOLS in node.meta:
                    return list(node.meta[THREAD_TOOLS])
        return session.tools
