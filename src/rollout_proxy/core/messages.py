"""The Anthropic Messages API on the response tree: the conversation attached by content, as Chat
Completions are, then extended by a turn (``core.turn_service``).

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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from rollout_proxy.core.tree import Placement, ResponseTree, place_sample
from rollout_proxy.core.turn_service import Ask
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


@dataclass(frozen=True, slots=True)
class MessagesPlacement:
    """A Messages API turn's placement (``core.turn_service.Placing``): ``hashes``, the messages' path hashes
    (computed with the session read); ``signed``, (message index, node id) of the assistant messages whose
    thinking the proxy signed; ``thread``, the message a server-held thread continues from."""

    hashes: Sequence[str] | None = None
    signed: Sequence[tuple[int, str]] = ()
    thread: Thread | None = None

    @property
    def api(self) -> str:
        return API

    async def place(self, tree: ResponseTree, lease: SessionLease, ask: Ask) -> Placement:
        """The parent by content, or by the signature of the last assistant message it covers (module
        docstring), or the message a thread continues from; a new root says how it holds the session's
        sample."""
        session, messages = lease.session, ask.messages
        if self.thread is not None:
            return await self._continue(tree, lease, messages, self.thread)
        named = dict(self.signed)
        placement = await tree.locate(session, messages, api=API, hashes=self.hashes, named=named, lease=lease)
        covered = len(messages) - len(placement.new_messages)
        last = covered - 1
        if placement.parent and last in named and placement.parent[-1].id != named[last]:
            path = await tree.path(session.id, named[last], param="messages", lease=lease)
            if path[-1].path_hash == placement.parent[-1].path_hash:  # the same conversation: only tokens differ
                log.info("parent_by_signature", parent_id=path[-1].id, by_content=placement.parent[-1].id)
                tree.metrics.inc("parents_by_signature_total", api=API)
                placement = Placement(
                    parent=path,
                    new_messages=placement.new_messages,
                    new_hashes=placement.new_hashes,
                    fork=placement.fork,
                )
        if not placement.parent:
            placement.sample = place_sample(session.messages, messages, insert=False)[1]
        return placement

    @staticmethod
    async def _continue(
        tree: ResponseTree, lease: SessionLease, messages: list[dict[str, Any]], thread: Thread
    ) -> Placement:
        """The thread's next turn: the new messages after the node ``thread`` names (an echo of its output
        dropped); a ``system`` sent again must be the one the thread started with (the policy saw it)."""
        try:
            placement = await tree.after(lease.session, thread.previous_message_id, messages, lease=lease)
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

    def tools(self, session: SessionRecord, placement: Placement, ask: Ask) -> list[dict[str, Any]] | None:
        """The turn's tools: the request's, else (continuing a thread) the ones its last turn that sent tools
        recorded (``THREAD_TOOLS``), else the session's."""
        if ask.tools is not None:
            return ask.tools
        if self.thread is not None:
            for node in reversed(placement.parent):
                if THREAD_TOOLS in node.meta:
                    return list(node.meta[THREAD_TOOLS])
        return session.tools

    def meta(self, session: SessionRecord, placement: Placement, ask: Ask) -> dict[str, Any] | None:
        return ask.meta
