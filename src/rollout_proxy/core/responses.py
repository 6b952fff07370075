"""The Responses API on the response tree: ``previous_response_id`` names the parent.

Only the new input is rendered (as bridge tokens after the parent's exact tokens);
nothing earlier is ever re-tokenized. Without ``previous_response_id`` the input is a whole
conversation from the root (``instructions`` first, as a system message), with the session's sample
placed in it by ``core.tree.place_sample``, attached by content as Chat Completions are. Messages a
client appends to a session (``POST /v1/sessions/{id}/messages``) are placed the same way
(``core.turn_service.TurnService.append``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from rollout_proxy.core.tree import Placement, ResponseTree, SamplePlacement, place_sample
from rollout_proxy.core.turn_service import Ask
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


@dataclass(frozen=True, slots=True)
class ResponsesPlacement:
    """A Responses turn's placement (``core.turn_service.Placing``); ``keys``: the messages'
    ``canonical_key``s when the caller has them (a resent input keyed once), and ``hashes`` their rolling path
    hashes (the resent-history memory computes them only past the list it kept); ``api``: ``"injected"`` for
    appended messages."""

    previous_response_id: str | None = None
    instructions: str | None = None
    store: bool = True
    keys: Sequence[bytes] | None = None
    hashes: Sequence[str] | None = None
    api: str = "responses"

    async def place(self, tree: ResponseTree, lease: SessionLease, ask: Ask) -> Placement:
        session, messages, keys = lease.session, ask.messages, self.keys
        if self.previous_response_id is not None:
            placement = await tree.after(session, self.previous_response_id, messages, lease=lease)
            if self.instructions is not None and self.instructions != root_instructions(placement.parent):
                raise InvalidRequest(
                    "instructions differ from the ones this conversation started with; the policy already saw "
                    "those, so they cannot change inside a conversation tree",
                    param="instructions",
                )
            return placement
        if self.instructions:  # the instructions are the conversation's first message, as the client's system prompt
            system = {"role": "system", "content": self.instructions}
            messages = [system, *messages]
            keys = None if keys is None else [canonical_key(system), *keys]
        conversation, sample = place_sample(session.messages, messages, keys=keys)
        hashes = None
        if keys is not None and sample is not SamplePlacement.INSERTED:
            # the messages as sent (no instructions put first): their hashes as the memory computed them
            given = self.hashes is not None and not self.instructions and len(self.hashes) == len(keys)
            hashes = self.hashes if given else path_hashes_of_keys(keys)
        placement = await tree.locate(session, conversation, api=self.api, hashes=hashes, lease=lease)
        placement.sample = sample
        return placement

    def tools(self, session: SessionRecord, placement: Placement, ask: Ask) -> list[dict[str, Any]] | None:
        return ask.tools if ask.tools is not None else session.tools

    def meta(self, session: SessionRecord, placement: Placement, ask: Ask) -> dict[str, Any]:
        """The request's, and the Responses fields (the instructions its conversation started with)."""
        meta = {
            **(ask.meta or {}),
            "previous_response_id": self.previous_response_id,
            "instructions": (
                self.instructions if self.previous_response_id is None else root_instructions(placement.parent)
            ),
            "store": self.store,
        }
        if ask.tools is not None and ask.tools != session.tools:
            meta["tools"] = ask.tools
        return meta
