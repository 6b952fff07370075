"""One turn service for every API: a request's ``Ask`` placed on the tree by its API's ``Placing``, then one
driver: prepare → sample (complete, or streamed) → record.

What differs per API is only where the turn goes and what its node records of the request: Chat
Completions attach the whole conversation by content (``core.chat``), the Responses API by
``previous_response_id`` or by content with ``instructions`` and the session's sample placed in it
(``core.responses``), the Messages API by content and signed thinking, or on a server-held thread
(``core.messages``). Everything after the placement is the same for the three: the engine request is built
in one place (``TurnRunner.prepare``: ``PreparedTurn``), sampled once, and recorded as one node. A
``count_tokens`` is a placement and its prompt, nothing sampled; appended messages (``append``) a placement
and a weight-0 node.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout_proxy.core.streaming import StreamEvent, TurnStreamer
from rollout_proxy.core.tree import Placement, ResponseTree
from rollout_proxy.core.turns import TurnResult, TurnRunner
from rollout_proxy.errors import InvalidRequest
from rollout_proxy.records import ResponseNode, SessionRecord
from rollout_proxy.state.store import Idempotency, SessionLease
from rollout_proxy.wire.images import ImageBlob


@dataclass(frozen=True, slots=True)
class Ask:
    """What a request asks of a turn, whatever its API: its conversation (normalized), the tools it sent
    (None: none, the session's or the thread's are rendered), its stop strings, what the node records of
    the request beyond its messages, and the images its conversation holds (checked: ``proxy.images``), by
    hash: those of the turn's new messages are stored with its node."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    stop: Sequence[str] = ()
    meta: dict[str, Any] | None = None
    images: Mapping[str, ImageBlob] = field(default_factory=dict)


class Placing(Protocol):
    """One API's placement of a request's turn (one request's: it carries what the API adds to the ask)."""

    @property
    def api(self) -> str:
        """The API name its nodes and metrics carry."""
        ...

    async def place(self, tree: ResponseTree, lease: SessionLease, ask: Ask) -> Placement:
        """Where the turn attaches (reads through ``lease``, the turn's session read)."""
        ...

    def tools(self, session: SessionRecord, placement: Placement, ask: Ask) -> list[dict[str, Any]] | None:
        """The tools the turn's prompt renders."""
        ...

    def meta(self, session: SessionRecord, placement: Placement, ask: Ask) -> dict[str, Any] | None:
        """What the node records of the request beyond its messages."""
        ...


@dataclass(frozen=True, slots=True)
class PlacedTurn:
    """A turn placed, and what its generation takes besides (``TurnRunner.generate``, ``TurnStreamer.stream``)."""

    placement: Placement
    arguments: dict[str, Any]  # api, tools, stop, meta, lease, images


class TurnService:
    def __init__(self, *, tree: ResponseTree, turns: TurnRunner) -> None:
        self._tree = tree
        self._turns = turns

    async def complete(self, lease: SessionLease, ask: Ask, placing: Placing) -> TurnResult:
        """One turn, answered once it is recorded."""
        turn = await self._placed(lease, ask, placing)
        return await self._turns.generate(lease.session, turn.placement, **turn.arguments)

    async def stream(self, lease: SessionLease, ask: Ask, placing: Placing) -> AsyncGenerator[StreamEvent, None]:
        """``complete``, streamed (``core.streaming``): the same node is recorded at the end. The turn is placed
        here (a refusal raises before any event); its events come straight from the streamer, not through one
        more generator (a few µs per delta)."""
        turn = await self._placed(lease, ask, placing)
        return TurnStreamer(self._turns).stream(lease.session, turn.placement, **turn.arguments)

    async def count_tokens(self, lease: SessionLease, ask: Ask, placing: Placing) -> int:
        """How many tokens the prompt of this turn would have: the parent's exact tokens and the bridge for the
        rest, rendered by the policy's template; nothing is sampled or stored."""
        placement = await placing.place(self._tree, lease, ask)
        tools = placing.tools(lease.session, placement, ask)
        return len(await self._turns.prompt_tokens(lease.session, placement, tools=tools, images=ask.images))

    async def append(
        self, lease: SessionLease, ask: Ask, placing: Placing, *, idempotency: Idempotency | None = None
    ) -> ResponseNode:
        """Messages the policy did not generate, as a weight-0 node that can be extended (the node that holds
        them already, when the tree does). With ``idempotency``, every request with that key makes at most one
        node, however many run at once: the store claims the key atomically with the write."""
        if not ask.messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        placement = await placing.place(self._tree, lease, ask)
        if not placement.new_messages:
            if placement.parent:  # all of it is already in the tree: that node is the answer
                return placement.parent[-1]
            raise InvalidRequest("messages add nothing to the conversation", param="messages")
        images = await self._turns.new_images(lease.session, placement, ask.images)
        return await self._turns.inject(
            lease.session, placement, api=placing.api, idempotency=idempotency, lease=lease, images=images
        )

    async def _placed(self, lease: SessionLease, ask: Ask, placing: Placing) -> PlacedTurn:
        """The turn placed, and the images its node will store checked against the session's bound (before
        anything is sampled)."""
        placement = await placing.place(self._tree, lease, ask)
        session = lease.session
        tools, meta = placing.tools(session, placement, ask), placing.meta(session, placement, ask)
        images = await self._turns.new_images(session, placement, ask.images)
        arguments = {"api": placing.api, "tools": tools, "stop": ask.stop, "meta": meta, "lease": lease}
        return PlacedTurn(placement, {**arguments, "images": images})
