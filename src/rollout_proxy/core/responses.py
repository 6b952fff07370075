"""The Responses API on the response tree: ``previous_response_id`` names the parent.

Only the new input is rendered (as bridge tokens after the parent's exact tokens);
nothing earlier is ever re-tokenized. Without ``previous_response_id`` the input is a whole
conversation from the root (``instructions`` first, as a system message), with the session's sample
placed in it by ``core.tree.place_sample``, attached by content as Chat Completions are.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import orjson

from rollout_proxy.core.streaming import StreamEvent, TurnStreamer
from rollout_proxy.core.tree import Placement, ResponseTree, SamplePlacement, place_sample
from rollout_proxy.core.turns import TurnResult, TurnRunner
from rollout_proxy.errors import InvalidRequest
from rollout_proxy.records import ResponseNode, SessionRecord
from rollout_proxy.state.store import Idempotency, SessionLease
from rollout_proxy.tokenization.messages import canonical_key, path_hashes_of_keys

MAX_IDEMPOTENCY_KEY = 255


def idempotency(
    key: str | None, messages: list[dict[str, Any]], previous_response_id: str | None
) -> Idempotency | None:
    """The key with a fingerprint of the request it stands for (the normalized body)."""
    if key is None:
        return None
    if not (0 < len(key) <= MAX_IDEMPOTENCY_KEY and key.isascii() and key.isprintable()):
        raise InvalidRequest(
            f"an Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters",
            param="Idempotency-Key",
        )
    body = orjson.dumps([previous_response_id, messages], option=orjson.OPT_SORT_KEYS)
    return Idempotency(key, hashlib.blake2b(body, digest_size=16).hexdigest())


def root_instructions(path: Sequence[ResponseNode]) -> str | None:
    return path[0].meta.get("instructions") if path else None


class ResponsesService:
    def __init__(self, *, tree: ResponseTree, turns: TurnRunner) -> None:
        self._tree = tree
        self._turns = turns

    async def _place(
        self,
        session: SessionRecord,
        messages: list[dict[str, Any]],
        *,
        previous_response_id: str | None,
        instructions: str | None,
        api: str,
        keys: Sequence[bytes] | None = None,
        lease: SessionLease | None = None,
    ) -> Placement:
        """``keys``: the messages' ``canonical_key``s when the caller has them (a resent input keyed once)."""
        if previous_response_id is not None:
            placement = await self._tree.after(session, previous_response_id, messages, lease=lease)
            if instructions is not None and instructions != root_instructions(placement.parent):
                raise InvalidRequest(
                    "instructions differ from the ones this conversation started with; the policy already saw "
                    "those, so they cannot change inside a conversation tree",
                    param="instructions",
                )
            return placement
        if instructions:  # the instructions are the conversation's first message, as the client's system prompt
            system = {"role": "system", "content": instructions}
            messages = [system, *messages]
            keys = None if keys is None else [canonical_key(system), *keys]
        conversation, sample = place_sample(session.messages, messages, keys=keys)
        hashes = None if keys is None or sample is SamplePlacement.INSERTED else path_hashes_of_keys(keys)
        placement = await self._tree.locate(session, conversation, api=api, hashes=hashes, lease=lease)
        placement.sample = sample
        return placement

    async def create(
        self,
        session: SessionRecord,
        messages: list[dict[str, Any]],
        *,
        previous_response_id: str | None,
        instructions: str | None,
        tools: list[dict[str, Any]] | None,
        store: bool,
        meta: dict[str, Any] | None = None,
        keys: Sequence[bytes] | None = None,
        lease: SessionLease | None = None,
    ) -> tuple[TurnResult, list[ResponseNode]]:
        """Generate one response; returns it and the path it extends. ``meta``: what the node records of the
        request beyond its messages and the Responses fields."""
        placement, meta = await self._placed(
            session,
            messages,
            previous_response_id=previous_response_id,
            instructions=instructions,
            tools=tools,
            store=store,
            meta=meta,
            keys=keys,
            lease=lease,
        )
        result = await self._turns.generate(
            session,
            placement,
            api="responses",
            tools=tools if tools is not None else session.tools,
            meta=meta,
            lease=lease,
        )
        return result, placement.parent

    async def stream(
        self,
        session: SessionRecord,
        messages: list[dict[str, Any]],
        *,
        previous_response_id: str | None,
        instructions: str | None,
        tools: list[dict[str, Any]] | None,
        store: bool,
        meta: dict[str, Any] | None = None,
        keys: Sequence[bytes] | None = None,
        lease: SessionLease | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        """``create``, streamed (``core.streaming``): the same node is recorded at the end."""
        placement, meta = await self._placed(
            session,
            messages,
            previous_response_id=previous_response_id,
            instructions=instructions,
            tools=tools,
            store=store,
            meta=meta,
            keys=keys,
            lease=lease,
        )
        events = TurnStreamer(self._turns).stream(
            session,
            placement,
            api="responses",
            tools=tools if tools is not None else session.tools,
            meta=meta,
            lease=lease,
        )
        async with contextlib.aclosing(events):
            async for event in events:
                yield event

    async def _placed(
        self,
        session: SessionRecord,
        messages: list[dict[str, Any]],
        *,
        previous_response_id: str | None,
        instructions: str | None,
        tools: list[dict[str, Any]] | None,
        store: bool,
        meta: dict[str, Any] | None,
        keys: Sequence[bytes] | None,
        lease: SessionLease | None,
    ) -> tuple[Placement, dict[str, Any]]:
        """Where the response goes, and the node's metadata."""
        placement = await self._place(
            session,
            messages,
            previous_response_id=previous_response_id,
            instructions=instructions,
            api="responses",
            keys=keys,
            lease=lease,
        )
        meta = {
            **(meta or {}),
            "previous_response_id": previous_response_id,
            "instructions": instructions if previous_response_id is None else root_instructions(placement.parent),
            "store": store,
        }
        if tools is not None and tools != session.tools:
            meta["tools"] = tools
        return placement, meta

    async def append_messages(
        self,
        session: SessionRecord,
        messages: list[dict[str, Any]],
        *,
        previous_response_id: str | None,
        idempotency_key: str | None = None,
    ) -> ResponseNode:
        """Messages the policy did not generate, as a weight-0 node that can be extended.

        With an ``idempotency_key``, every request with that key makes at most one node,
        however many run at once: the store claims the key atomically with the write."""
        claim = idempotency(idempotency_key, messages, previous_response_id)
        if not messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        placement = await self._place(
            session, messages, previous_response_id=previous_response_id, instructions=None, api="injected"
        )
        if not placement.new_messages:
            if placement.parent:  # all of it is already in the tree: that node is the answer
                return placement.parent[-1]
            raise InvalidRequest("messages add nothing to the conversation", param="messages")
        return await self._turns.inject(session, placement, api="injected", idempotency=claim)
