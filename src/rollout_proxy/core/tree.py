"""Where a request attaches to a session's response tree.

Two ways to name a parent:

- by content (Chat Completions, and Responses calls without ``previous_response_id``):
  the deepest node whose message path is a prefix of the conversation, found with one
  store read of the rolling path hashes. When the conversation agrees with part of an
  existing node's messages and then differs, it rewrote history: the new node forks
  there and records which node it diverged from and at which message, never
  splicing silently;
- by id (``previous_response_id``): that node, within the session.

The root's conversation is the sample's messages; a request that starts without a
parent gets them prepended unless it already starts with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from rollout_proxy.errors import InvalidRequest, NotFound
from rollout_proxy.metrics import Metrics
from rollout_proxy.records import ResponseNode, SessionRecord
from rollout_proxy.state.store import StateStore
from rollout_proxy.tokenization.messages import EMPTY_PATH_HASH, canonical_key, path_hashes, same_messages

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Placement:
    """Where new messages attach: the parent's path, the messages, and their path hashes.

    The hashes are computed once, when the parent is found, and stored with the new node.
    """

    parent: list[ResponseNode]  # root-to-parent path; empty for the root
    new_messages: list[dict[str, Any]]
    new_hashes: list[str]  # rolling path hash after each new message
    fork: dict[str, Any] | None = None

    @property
    def parent_id(self) -> str | None:
        return self.parent[-1].id if self.parent else None

    @property
    def end_hash(self) -> str:
        """The path hash after the last new message (the parent's own when there is none)."""
        if self.new_hashes:
            return self.new_hashes[-1]
        return self.parent[-1].path_hash if self.parent else EMPTY_PATH_HASH


#: How many of a conversation's last path hashes a turn looks up first. A turn usually resends the
#: history it was given plus a few messages, so the deepest whole-node match is among the last few:
#: the rolling hashes make a match there vouch for every message before it, and the lookup does not
#: grow with the history. Only when none of them ends a node (a new conversation, or history rewritten
#: further back) is the whole list looked up.
MATCH_WINDOW = 8


def match_window(hashes: Sequence[str]) -> tuple[str, ...]:
    """The hashes a turn looks up first (``MATCH_WINDOW``)."""
    return tuple(hashes[-MATCH_WINDOW:])


def choose_parent(
    matches: Sequence[str | None], n_messages: int, *, offset: int = 0
) -> tuple[str | None, int, dict[str, Any] | None]:
    """(parent id, how many messages it covers, fork provenance or None).

    ``matches[i]`` is the path-index entry for the first ``offset``+i+1 messages: ``"id"`` where
    a node's path ends, ``"id#k"`` inside a node's messages. Only the deepest entry
    inside a node decides: the request forks there if it goes on past it with other
    messages, and is a sibling of that node's output if it simply ends there (a group's
    samples all send the same prompt).
    """
    parent_id, covered = None, 0
    for index in range(len(matches) - 1, -1, -1):  # the deepest whole-node entry
        value = matches[index]
        if value is not None and "#" not in value:
            parent_id, covered = value, offset + index + 1
            break
    for index in range(len(matches) - 1, covered - offset - 1, -1):
        value = matches[index]
        if value is not None and "#" in value:
            if offset + index + 1 < n_messages:
                at = offset + index + 1
                return parent_id, covered, {"diverged_from": value.split("#", 1)[0], "at_message": at}
            break
    return parent_id, covered, None


def with_sample(session: SessionRecord, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation that starts at the root: the sample's messages, then ``messages``."""
    sample = session.messages
    if same_messages(messages[: len(sample)], sample):
        return list(messages)
    return [*sample, *messages]


class ResponseTree:
    def __init__(self, *, store: StateStore, metrics: Metrics) -> None:
        self._store = store
        self._metrics = metrics

    async def path(
        self, session_id: str, response_id: str, *, param: str = "previous_response_id"
    ) -> list[ResponseNode]:
        path = await self._store.get_path(session_id, response_id)
        if path is None:
            raise NotFound(f"response {response_id!r} not found in this session", param=param)
        return path

    async def locate(
        self, session: SessionRecord, messages: list[dict[str, Any]], *, api: str, hashes: Sequence[str] | None = None
    ) -> Placement:
        """Attach a whole conversation by content (``hashes``: its path hashes, if the caller has them)."""
        if not messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        hashes = path_hashes(messages) if hashes is None else list(hashes)
        offset = len(hashes) - len(window := match_window(hashes))
        matches = await self._store.match_paths(session.id, window)  # a match there vouches for all before it
        if offset and not any(value is not None and "#" not in value for value in matches):
            matches, offset = await self._store.match_paths(session.id, hashes), 0  # no node ends in the window
        parent_id, covered, fork = choose_parent(matches, len(messages), offset=offset)
        if fork is not None:
            self._metrics.inc("forks_total", api=api)
            log.info("history_rewritten", parent_id=parent_id, **fork)
        parent = [] if parent_id is None else await self.path(session.id, parent_id, param="messages")
        return Placement(parent=parent, new_messages=messages[covered:], new_hashes=hashes[covered:], fork=fork)

    async def after(
        self, session: SessionRecord, previous_response_id: str, messages: list[dict[str, Any]]
    ) -> Placement:
        """Attach new messages under a named node; an echo of its own output is dropped."""
        parent = await self.path(session.id, previous_response_id)
        own, own_hash = parent[-1].messages[-1], parent[-1].path_hash
        if messages and messages[0]["role"] == own["role"] and canonical_key(messages[0]) == canonical_key(own):
            messages = messages[1:]
        return Placement(parent=parent, new_messages=messages, new_hashes=path_hashes(messages, start=own_hash))
