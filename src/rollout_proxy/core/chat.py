"""Chat Completions: the conversation is attached by content, then extended by a turn (``core.turn_service``).

The client sends the whole conversation and the policy sees it as sent: a new root whose conversation
does not hold the session's sample (or only part of it) is flagged, never given the sample
(``core.tree.place_sample``, ``insert=False``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollout_proxy.core.tree import Placement, ResponseTree, place_sample
from rollout_proxy.core.turn_service import Ask
from rollout_proxy.records import SessionRecord
from rollout_proxy.state.store import SessionLease


@dataclass(frozen=True, slots=True)
class ChatPlacement:
    """A Chat Completions turn's placement (``core.turn_service.Placing``); ``hashes``: the messages' path
    hashes when the caller already has them (the intake's)."""

    hashes: Sequence[str] | None = None

    @property
    def api(self) -> str:
        return "chat"

    async def place(self, tree: ResponseTree, lease: SessionLease, ask: Ask) -> Placement:
        """The parent by content; a new root says how it holds the session's sample."""
        session = lease.session
        placement = await tree.locate(session, ask.messages, api="chat", hashes=self.hashes, lease=lease)
        if not placement.parent:
            placement.sample = place_sample(session.messages, ask.messages, insert=False)[1]
        return placement

    def tools(self, session: SessionRecord, placement: Placement, ask: Ask) -> list[dict[str, Any]] | None:
        return ask.tools if ask.tools is not None else session.tools

    def meta(self, session: SessionRecord, placement: Placement, ask: Ask) -> dict[str, Any] | None:
        return ask.meta
